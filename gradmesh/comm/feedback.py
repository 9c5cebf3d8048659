"""Compression with error feedback: PowerSGD (low rank) and top-k (sparse).

Both send a lossy summary of each gradient and keep what it left out (the error) on the rank,
adding it to the next step's gradient, so nothing is lost for good (Seide et al. 2014; Stich et
al. 2018; Karimireddy et al. 2019):
- PowerSGD (Vogels et al. 2019), rank r: a gradient viewed as an n x m matrix M (plus its error)
  is sent as P = M Q (n x r, averaged, then orthonormalised) and Q = M^T P (m x r, averaged); the
  mean gradient is taken as P Q^T. Q is kept for the next step (a warm start, one power-iteration
  step per training step) and begins from the same seeded random matrix on every rank.
- top-k, ratio K: each rank sends its ceil(K x numel) largest entries (by magnitude) and their
  indices to every other (all-gather); the mean is the sum of everyone's entries over the ranks.
Vectors (biases, norms: few bytes, and top-k's error would delay them most) and matrices the
method would not shrink go as plain fp32 means, as do all tensors during the first `start` steps
(DDP rebuilds its buckets after the first step). Top-k suits SGD better than Adam: an entry sent
once in T steps carries T steps of gradient, so Adam's second moment grows about T-fold for it
and its steps shrink by about sqrt(T). A dense warm-up (`start`) lets Adam's moments settle
first; freezing Adam's second moment once compression starts, as 1-bit Adam does, and choosing
entries by their Adam-scaled size both did worse (docs/benchmarks.md#convergence).

torch ships a PowerSGD hook, but its state follows DDP's bucket indices, which change when DDP
rebuilds the buckets and differ in a resumed process, it cannot be checkpointed, and it calls the
collectives itself (uncounted, untimed). Here the state is kept per parameter name, whatever the
bucket layout, so it goes into checkpoints and a resumed run continues exactly; the collectives
are blocking (each bucket's exchange finishes inside DDP's hook, which gives up overlapping it
with the rest of backward).
"""

import math
import zlib

import torch
import torch.distributed as dist

from gradmesh.comm.reducer import Reducer

Parts = list[tuple[str, torch.Size]]


def _done(tensor: torch.Tensor) -> torch.futures.Future:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


def _mean(pieces: list[torch.Tensor], group) -> None:
    """All-reduce the mean of `pieces` (views into a bucket) as one flat tensor."""
    if not pieces:
        return
    flat = torch.cat([p.reshape(-1) for p in pieces]).div_(group.size())
    dist.all_reduce(flat, group=group)
    offset = 0
    for piece in pieces:
        piece.copy_(flat[offset : offset + piece.numel()].view_as(piece))
        offset += piece.numel()


class ErrorFeedback(Reducer):
    """The part both methods share: per-parameter error, the plain/compressed split, state."""

    carries_nonfinite = False  # a low-rank or top-k summary need not keep one rank's NaN
    exchanges = 1
    """Collectives `exchange` makes."""

    def __init__(self, start: int = 0):
        self.start = start
        self.errors: dict[str, torch.Tensor] = {}
        self.seen: dict[str, int] = {}
        """How many steps each parameter has been reduced in."""

    def compresses(self, shape: torch.Size) -> bool:
        raise NotImplementedError

    def compressed_bytes(self, shape: torch.Size) -> int:
        raise NotImplementedError

    def exchange(self, named: list[tuple[str, torch.Tensor]], group) -> None:
        """Replace each (name, gradient + error) by the compressed mean; set each error."""
        raise NotImplementedError

    def _split(self, tensor: torch.Tensor, parts: Parts | None):
        if parts is None:
            raise RuntimeError(f"--compression {self.name} needs each parameter's place in the bucket")
        plain, named, offset = [], [], 0
        for name, shape in parts:
            piece = tensor[offset : offset + math.prod(shape)]
            offset += piece.numel()
            if self.seen.get(name, 0) >= self.start and self.compresses(shape):
                named.append((name, piece.view(shape)))
            else:
                plain.append(piece)
        return plain, named

    def wire_bytes(self, tensor, parts=None):
        plain, named = self._split(tensor, parts)
        return sum(4 * p.numel() for p in plain) + sum(self.compressed_bytes(g.shape) for _, g in named)

    def collectives(self, tensor, parts=None):
        plain, named = self._split(tensor, parts)
        return int(bool(plain)) + (self.exchanges if named else 0)

    def reduce(self, tensor, group, parts=None):
        plain, named = self._split(tensor, parts)
        for name, _ in parts:
            self.seen[name] = self.seen.get(name, 0) + 1
        _mean(plain, group)
        for name, gradient in named:
            if name in self.errors:
                gradient.add_(self.errors[name])
        if named:
            self.exchange(named, group)
        return _done(tensor)

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {f"seen.{name}": torch.tensor(count) for name, count in self.seen.items()}
        state.update({f"error.{name}": error for name, error in self.errors.items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for key, value in state.items():
            kind, _, name = key.partition(".")
            if kind == "seen":
                self.seen[name] = int(value.item())
            elif kind == "error":
                self.errors[name] = value.clone()


class PowerSGD(ErrorFeedback):
    exchanges = 2  # P, then Q

    def __init__(self, rank: int, start: int):
        super().__init__(start)
        self.rank, self.name = rank, f"powersgd_rank{rank}"
        self.qs: dict[str, torch.Tensor] = {}

    @staticmethod
    def _matrix(shape: torch.Size) -> tuple[int, int]:
        return shape[0], math.prod(shape[1:])

    def compresses(self, shape):
        n, m = self._matrix(shape) if len(shape) >= 2 else (1, 1)
        return len(shape) >= 2 and self.rank * (n + m) < n * m

    def compressed_bytes(self, shape):
        n, m = self._matrix(shape)
        return 4 * self.rank * (n + m)

    def _q(self, name: str, m: int, like: torch.Tensor) -> torch.Tensor:
        if name not in self.qs:  # the same on every rank: seeded by the parameter's name
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            self.qs[name] = torch.randn(m, self.rank, generator=generator).to(like)
        return self.qs[name]

    def exchange(self, named, group):
        matrices = [gradient.reshape(self._matrix(gradient.shape)) for _, gradient in named]
        ps = [matrix @ self._q(name, matrix.shape[1], matrix) for (name, _), matrix in zip(named, matrices)]
        _mean(ps, group)
        ps = [torch.linalg.qr(p).Q for p in ps]
        qs = [matrix.T @ p for matrix, p in zip(matrices, ps)]
        _mean(qs, group)
        for (name, gradient), matrix, p, q in zip(named, matrices, ps, qs):
            approx = p @ q.T
            self.errors[name] = matrix.sub(approx).view_as(gradient)
            self.qs[name] = q
            gradient.copy_(approx.view_as(gradient))

    def state_dict(self):
        return {**super().state_dict(), **{f"q.{name}": q for name, q in self.qs.items()}}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.qs.update({key[2:]: value.clone() for key, value in state.items() if key.startswith("q.")})


class TopK(ErrorFeedback):
    def __init__(self, ratio: float, start: int = 0):
        super().__init__(start)
        self.ratio, self.name = ratio, f"topk_{ratio:g}"

    def _k(self, shape: torch.Size) -> int:
        return max(1, math.ceil(self.ratio * math.prod(shape)))

    def compresses(self, shape):
        return len(shape) >= 2 and 2 * self._k(shape) < math.prod(shape)  # an index and a value per entry kept

    def compressed_bytes(self, shape):
        return 8 * self._k(shape)

    def exchange(self, named, group):
        packed, kept = [], []
        for name, gradient in named:
            flat = gradient.reshape(-1)
            indices = flat.abs().topk(self._k(gradient.shape), sorted=False).indices
            values = flat[indices]
            error = flat.clone()
            error[indices] = 0
            self.errors[name] = error.view_as(gradient)
            packed += [values.float(), indices.int().view(torch.float32)]  # one all-gather for both
            kept.append(len(indices))
        mine = torch.cat(packed)
        everyone = [torch.empty_like(mine) for _ in range(group.size())]
        dist.all_gather(everyone, mine, group=group)
        for (_, gradient), start, k in zip(named, _offsets(kept), kept):
            total = torch.zeros(gradient.numel(), dtype=gradient.dtype, device=gradient.device)
            for theirs in everyone:  # rank order, whatever the arrival order
                total.index_add_(
                    0,
                    theirs[start + k : start + 2 * k].view(torch.int32).long(),
                    theirs[start : start + k].to(gradient.dtype),
                )
            gradient.copy_(total.div_(group.size()).view_as(gradient))


def _offsets(kept: list[int]) -> list[int]:
    """Where each tensor's (values, indices) begin in the packed buffer."""
    starts, at = [], 0
    for k in kept:
        starts.append(at)
        at += 2 * k
    return starts


def powersgd(row, parameters: dict) -> PowerSGD:
    """The compressor registry's builder for `powersgd:rank=R[,start=N]`."""
    return PowerSGD(parameters["rank"], parameters["start"])


def topk(row, parameters: dict) -> TopK:
    """The compressor registry's builder for `topk:ratio=K[,start=N]`."""
    return TopK(parameters["ratio"], parameters.get("start", 0))
