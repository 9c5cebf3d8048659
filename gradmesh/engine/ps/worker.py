"""A parameter-server worker: take a share, pull the parameters, compute, push the gradient.

The model's parameters and gradients are views into two flat buffers laid out as the servers
shard them, so a pull receives each server's shard straight into the parameters and a push
sends a range of the gradient buffer with no copy. Each server's shard is cut into buckets; a
hook on every parameter's accumulated gradient pushes a bucket as soon as backward has produced
all of it, so pushing overlaps the rest of backward.
"""

import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from gradmesh.comm.ps_wire import Kind, Message, Wire
from gradmesh.data import fetch
from gradmesh.data.sampler import split_evenly
from gradmesh.engine.base import to_device
from gradmesh.engine.ps.segment import Segment
from gradmesh.engine.ps.timing import RoleClock
from gradmesh.parallel.ps import Layout, Roles


@dataclass
class Share:
    """What one worker did for one step (it may have computed several shares of it, or none)."""

    loss: float = 0.0
    samples: int = 0
    indices: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The parameter version each share was computed from (the lowest over servers)."""


def flat_views(model: nn.Module, device: torch.device, gradients: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(parameters, gradients): flat buffers the model's parameters (and gradients) now view."""
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params]).to(device)
    grads = torch.zeros_like(flat) if gradients else None
    offset = 0
    for p in params:
        n = p.numel()
        p.data = flat[offset:offset + n].view_as(p)
        if grads is not None:
            p.grad = grads[offset:offset + n].view_as(p)
        offset += n
    return flat, grads


class Worker:
    def __init__(self, roles: Roles, layout: Layout, model: nn.Module, flat, grads, wire: Wire, job,
                 bound: int | None, bucket_elements: int, device: torch.device):
        self.roles, self.layout, self.model = roles, layout, model
        self.flat, self.grads, self.wire, self.job, self.bound, self.device = flat, grads, wire, job, bound, device
        self.buckets = [(s, k, low, high) for s in range(roles.servers)
                        for k, (low, high) in enumerate(layout.buckets(s, bucket_elements))]
        self.of_param: list[list[int]] = [[] for _ in layout.numels]
        self.needed = []  # per bucket: the parameters whose gradients it waits for
        for b, (_, _, low, high) in enumerate(self.buckets):
            overlapping = layout.params_in(low, high)
            self.needed.append(len(overlapping))
            for index in overlapping:
                self.of_param[index].append(b)
        self.missing = list(self.needed)
        self.pushing, self.task = False, (0, 0, 0)
        self.compute_s = 0.0
        self.clock = RoleClock("worker")
        for index, p in enumerate(model.parameters()):
            p.register_post_accumulate_grad_hook(lambda p, index=index: self._produced(index))

    def run(self, segment: Segment, probe) -> dict[int, Share]:
        """Take shares until the dispatcher has none left; what was done, per step."""
        done = {clock: Share() for clock in segment.clocks}
        while True:
            with self.clock.phase("wait"):
                self.wire.send(self.roles.dispatcher, Message(Kind.TAKE))
                reply = self.wire.receive_from(self.roles.dispatcher)
            if reply.kind == Kind.DONE:
                break
            least = reply.clock - self.bound if self.bound is not None else 0
            versions = self.pull(least)
            indices = segment.indices(reply.clock, reply.chunk)
            loss = self.compute(indices, segment.batch(reply.clock).size, (reply.clock, reply.chunk, versions), probe)
            share = done[reply.clock]
            share.loss, share.samples = share.loss + loss, share.samples + len(indices)
            share.indices += indices
            share.versions.append(min(versions))
            self.clock.samples += len(indices)
        with self.clock.phase("push"):
            self.wire.settle()
        return done

    def pull(self, least: int) -> list[int]:
        """Every server's shard, once its version is at least `least`; each server's version."""
        with self.clock.phase("push"):
            self.wire.settle()
        with self.clock.phase("pull"):
            return self._pull(least)

    def _pull(self, least: int) -> list[int]:
        posted = []
        for s in range(self.roles.servers):
            server = self.roles.server_rank(s)
            self.wire.send(server, Message(Kind.PULL, version=least))
            low, high = self.layout.shard(s)
            posted.append((self.wire.expect(server), self.wire.payload_from(server, self.flat[low:high])))
        versions = []
        for (head, head_work), payload_work in posted:
            head_work.wait()
            payload_work.wait()
            versions.append(Message.decode(head).version)
        return versions

    def compute(self, indices: list[int], batch_size: int, task: tuple[int, int, list[int]], probe) -> float:
        """Forward and backward of one share (weighted 1 / global batch, as data parallelism
        weights it); its buckets go out as backward produces them, then a commit to every server."""
        self.grads.zero_()
        self.task, self.missing = task, list(self.needed)
        micro = [m for m in split_evenly(indices, self.job.train.grad_accum) if m]
        with self.clock.phase("compute"):  # an injected straggler shows as slow compute...
            probe.straggle(self.compute_s)
        loss_sum, started = 0.0, time.perf_counter()  # ...but its delay is not part of its own time
        for i, part in enumerate(micro):
            with self.clock.phase("data"):
                data = to_device(fetch(self.job.dataset, part), self.device)
            with self.clock.phase("compute"):
                losses = self.job.loss_fn(self.model, data)
                self.pushing = i == len(micro) - 1
                (losses.sum() / batch_size).backward()
                loss_sum += losses.detach().sum().item()
        self.pushing = False
        self.compute_s = time.perf_counter() - started
        for b in range(len(self.buckets)):  # parameters that got no gradient (unused this step) still push zeros
            if self.missing[b] > 0:
                self.missing[b] = 0
                self._push(b)
        norm_sq = self.grads.double().pow(2).sum().item()
        clock, chunk, versions = task
        for s in range(self.roles.servers):
            self.wire.send(self.roles.server_rank(s), Message(Kind.COMMIT, clock=clock, chunk=chunk, version=versions[s],
                                                              samples=len(indices), loss=loss_sum, norm_sq=norm_sq))
        return loss_sum

    def _produced(self, index: int) -> None:
        if not self.pushing:
            return
        for b in self.of_param[index]:
            self.missing[b] -= 1
            if self.missing[b] == 0:
                self._push(b)

    def _push(self, bucket: int) -> None:
        server, k, low, high = self.buckets[bucket]
        clock, chunk, versions = self.task
        self.wire.send(self.roles.server_rank(server), Message(Kind.PUSH, clock=clock, chunk=chunk,
                                                               version=versions[server], bucket=k), self.grads[low:high])
