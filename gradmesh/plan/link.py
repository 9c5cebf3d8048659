"""Calibrating the links between ranks: a short run of real collectives, fitted to alpha-beta.

What is measured: `world` processes on this machine form a real process group (gloo over
loopback by default) and time all_reduce, all_gather, reduce_scatter, broadcast and a one-way
send/recv from rank 0 to rank 1 at a few buffer sizes, after one warm-up call each (it connects
the pairs and allocates gloo's buffers). A call takes its slowest rank's time (the job waits for
the last rank); a point is the lower quartile of its repeats, not their median: other processes
only add time, and on a busy machine most calls wait for a core at some step of the ring (at
load 5-8 on 2 cores, the median of 7 missed a held-out size by over 30% in half the runs).

The model is Hockney's (R. W. Hockney, "The communication challenge for MPP: Intel Paragon and
Meiko CS-2", Parallel Computing 20, 1994): a message of n bytes takes alpha + n·beta, alpha the
start-up latency and beta the seconds per byte. A collective over N ranks is costed by the bytes
its algorithm moves through one rank's link (R. Thakur, R. Rabenseifner and W. Gropp,
"Optimization of collective communication operations in MPICH", IJHPCA 19(1), 2005):

    all_reduce (ring: reduce-scatter, then all-gather)  2(N-1)/N · n
    all_gather, reduce_scatter (ring)                   (N-1)/N · n
    broadcast (binomial tree, what gloo runs)           ceil(log2 N) · n
    p2p (one message)                                   n

n being the whole buffer (for all_gather and reduce_scatter the gathered or scattered tensor).
Each kind gets its own alpha and beta at the world size it was timed at; the ring's 2(N-1) start-ups
fold into that alpha, so a profile predicts for its own world only.
"""

import math
import multiprocessing
import os
import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# torch is imported only where ranks are spawned (and in link_ranks, their side): the planner's
# CLI reads cached profiles and fits without paying torch's import.

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")
KIB, MIB = 1024, 1024 * 1024
DEFAULT_SIZES = (4 * KIB, 64 * KIB, 512 * KIB, 2 * MIB, 8 * MIB)  # latency-bound to bandwidth-bound
FORMAT = 1  # of `LinkProfile.to_json`: a cached calibration of another format is measured again


def bytes_moved(kind: str, nbytes: float, world: int) -> float:
    """The bytes of an `nbytes` buffer that one rank's link carries in `kind` over `world` ranks."""
    if world <= 1:
        return 0.0
    factors = {
        "all_reduce": 2 * (world - 1) / world,
        "all_gather": (world - 1) / world,
        "reduce_scatter": (world - 1) / world,
        "broadcast": float(math.ceil(math.log2(world))),
        "p2p": 1.0,
    }
    if kind not in factors:
        raise ValueError(f"unknown communication kind {kind!r}; known: {', '.join(KINDS)}")
    return factors[kind] * nbytes


def latency_steps(kind: str, world: int) -> int:
    """Start-ups one `kind` call pays in sequence over `world` ranks: a ring's steps (all-reduce
    2(N-1), all-gather and reduce-scatter N-1), a binomial tree's levels (broadcast), one message."""
    if world <= 1:
        return 0
    steps = {
        "all_reduce": 2 * (world - 1),
        "all_gather": world - 1,
        "reduce_scatter": world - 1,
        "broadcast": math.ceil(math.log2(world)),
        "p2p": 1,
    }
    return steps[kind]


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(alpha, beta) >= 0 minimising the relative squared error of alpha + x·beta against t, over
    (x, t) points (x: bytes moved, t: seconds > 0).

    Relative, not absolute: the sizes span three orders of magnitude, and plain least squares
    would let the largest size decide both parameters, leaving alpha to its noise. The problem is
    convex, so the constrained optimum is the best feasible of the unconstrained fit and the two
    boundary fits (alpha = 0, beta = 0)."""
    scale = max((x for x, _ in points), default=0.0) or 1.0  # conditions the sums; undone on beta
    rows = [(1.0 / t, x / scale / t) for x, t in points if t > 0]  # (alpha + x·beta) / t ≈ 1
    if not rows:
        raise ValueError("no timed points to fit")
    uu, uv, vv = (sum(r[i] * r[j] for r in rows) for i, j in ((0, 0), (0, 1), (1, 1)))
    su, sv = sum(r[0] for r in rows), sum(r[1] for r in rows)
    candidates = [(su / uu, 0.0), (0.0, sv / vv if vv else 0.0)]
    det = uu * vv - uv * uv
    if det > 0:
        candidates.append(((su * vv - sv * uv) / det, (sv * uu - su * uv) / det))
    feasible = [fit for fit in candidates if fit[0] >= 0 and fit[1] >= 0]
    alpha, beta = min(feasible, key=lambda fit: sum((fit[0] * u + fit[1] * v - 1) ** 2 for u, v in rows))
    return alpha, beta / scale


@dataclass(frozen=True)
class LinkFit:
    """One kind's fitted model and the points it was fitted to."""

    alpha_s: float
    beta_s_per_byte: float
    points: tuple[tuple[int, float], ...] = ()
    """(buffer bytes, seconds) as measured, before `bytes_moved` turned them into link bytes."""


@dataclass(frozen=True)
class LinkProfile:
    """The links of `world` ranks as calibrated: predicts a collective's seconds from its bytes."""

    world: int
    backend: str
    threads: int
    fits: dict[str, LinkFit] = field(default_factory=dict)

    def predict(self, kind: str, nbytes: float) -> float:
        """Seconds one `kind` call on an `nbytes` buffer takes (0 on one rank: nothing moves)."""
        moved = bytes_moved(kind, nbytes, self.world)
        if self.world <= 1:
            return 0.0
        if kind not in self.fits:
            raise KeyError(f"{kind!r} was not calibrated; this profile has {', '.join(self.fits) or 'no kinds'}")
        fit = self.fits[kind]
        return fit.alpha_s + moved * fit.beta_s_per_byte

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types, for the calibration cache (read back by `from_json`, never unpickled)."""
        kinds = {
            kind: {"alpha_s": f.alpha_s, "beta_s_per_byte": f.beta_s_per_byte, "points": [list(p) for p in f.points]}
            for kind, f in self.fits.items()
        }
        return {"format": FORMAT, "world": self.world, "backend": self.backend, "threads": self.threads, "kinds": kinds}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "LinkProfile":
        """The profile `to_json` wrote; ValueError on anything else (another format, a torn file)."""
        try:
            if data["format"] != FORMAT:
                raise ValueError(f"calibration format {data['format']!r}, expected {FORMAT}")
            fits = {str(kind): _fit_from_json(entry) for kind, entry in data["kinds"].items()}
            return cls(int(data["world"]), str(data["backend"]), int(data["threads"]), fits)
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"not a link calibration: {error!r}") from error


def _fit_from_json(entry: dict[str, Any]) -> LinkFit:
    points = tuple((int(nbytes), float(seconds)) for nbytes, seconds in entry["points"])
    return LinkFit(float(entry["alpha_s"]), float(entry["beta_s_per_byte"]), points)


@dataclass(frozen=True)
class Job:
    """What every rank measures (sent to the spawned ranks, so plain values only)."""

    backend: str
    threads: int
    sizes: tuple[int, ...]
    repeats: int
    kinds: tuple[str, ...]
    timeout_s: float


def measure_link(
    world: int,
    *,
    backend: str = "gloo",
    threads: int = 1,
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    repeats: int = 3,
    kinds: tuple[str, ...] = KINDS,
    timeout_s: float = 120.0,
) -> LinkProfile:
    """Spawn `world` ranks on this machine, time `kinds` at `sizes` and fit each kind.

    `backend`: one that takes CPU tensors (gloo). `threads`: torch threads per rank (gloo reduces
    on the CPU). `timeout_s` bounds the whole calibration; past it the ranks are killed and
    TimeoutError raised. One rank spawns nothing and predicts 0."""
    if world < 1 or threads < 1 or repeats < 1 or not sizes or min(sizes) < 1:
        raise ValueError(f"world, threads, repeats and sizes must be positive: {world}, {threads}, {repeats}, {sizes}")
    for kind in kinds:
        bytes_moved(kind, 0, 2)  # an unknown kind fails here, not in a spawned rank
    if world == 1:
        return LinkProfile(1, backend, threads, {kind: LinkFit(0.0, 0.0) for kind in kinds})
    job = Job(backend, threads, tuple(int(s) for s in sizes), repeats, tuple(kinds), timeout_s)
    measured = _run_ranks(world, job)
    fits = {
        kind: LinkFit(*fit_alpha_beta([(bytes_moved(kind, b, world), t) for b, t in points]), tuple(points))
        for kind, points in measured.items()
    }
    return LinkProfile(world, backend, threads, fits)


def _run_ranks(world: int, job: Job) -> dict[str, list[tuple[int, float]]]:
    """Start the ranks around a store on 127.0.0.1 and wait for rank 0's points; none outlives this."""
    from gradmesh import stores
    from gradmesh.plan import link_ranks

    context = multiprocessing.get_context("spawn")  # a forked child would inherit torch's threads mid-state
    results = context.Queue()
    store = stores.loopback_store()  # a local: it serves until this function returns
    ranks = [
        context.Process(
            target=link_ranks.rank_main, args=(rank, world, store.port, os.getpid(), job, results), daemon=True
        )
        for rank in range(world)
    ]
    grace_s = 0.0  # a failed or timed-out calibration kills its ranks at once
    try:
        for process in ranks:
            process.start()
        message = _wait_for_result(ranks, results, time.monotonic() + job.timeout_s)
        grace_s = 5.0  # the ranks have reported and are leaving
    finally:
        _stop(ranks, grace_s)
        results.close()
    return _points_from(message, job)


def _stop(ranks: Sequence[Any], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for process in (p for p in ranks if p.pid is not None):  # those started
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def _wait_for_result(ranks: Sequence[Any], results: Any, deadline: float) -> Any:
    """Rank 0's message; a rank that died or a calibration past its deadline raises instead."""
    while True:
        try:
            return results.get(timeout=0.1)
        except queue.Empty:
            pass
        failed = [(rank, p.exitcode) for rank, p in enumerate(ranks) if p.exitcode not in (None, 0)]
        if failed:
            raise RuntimeError(f"link calibration: rank {failed[0][0]} exited with code {failed[0][1]}; see its stderr")
        if time.monotonic() > deadline:
            raise TimeoutError(f"link calibration of {len(ranks)} ranks took longer than its timeout; ranks killed")


def _points_from(message: Any, job: Job) -> dict[str, list[tuple[int, float]]]:
    """Rank 0's points, checked to be the plain numbers asked for."""
    if not isinstance(message, dict) or set(message) != set(job.kinds):
        raise RuntimeError(f"link calibration: unexpected result {str(message)[:200]}")
    return {kind: [(int(b), float(t)) for b, t in message[kind]] for kind in job.kinds}
