"""`--compression auto`: measure the link once, then compress only where communication costs.

The first steps run uncompressed (PowerSGD's own first steps are plain too). After step 2, every
data-parallel rank times a few all-reduces of a 4 MiB probe (the slowest rank's time counts) and
estimates what the uncompressed gradient all-reduce takes per step: 2(N-1)/N x 4 bytes x
parameters / bandwidth. Set against the step's compute (step 2's time less that estimate):
- at most 10% of compute: none (on a fast link compression only costs time:
  docs/benchmarks.md#loopback);
- more: PowerSGD rank 4 where at least half the parameters are in matrices it shrinks (near
  uncompressed loss on a small share of the bytes over a slow link: docs/benchmarks.md#compression),
  else bf16 (half the bytes, a rounding error's loss).
The figures and the choice go to `RUN_DIR/compression.json` and the console.
"""

import math
import time

import torch
import torch.distributed as dist

from gradmesh.comm.compress import reducer_for
from gradmesh.comm.feedback import ErrorFeedback
from gradmesh.comm.reducer import MeanAllReduce, Reducer
from gradmesh.config import compression as compressors

PROBE_BYTES = 4 * 2**20
DECIDE_AFTER = 2
"""Steps run uncompressed before the probe (the first carries one-off costs)."""
SHARE = 0.1
"""Compress when the estimated all-reduce exceeds this share of a step's compute."""


class AutoCompression(Reducer):
    """The plain mean until `choose` names the reducer to use from then on."""

    carries_nonfinite = False  # what it will choose is not known when the engine is built

    def __init__(self):
        self.inner: Reducer = MeanAllReduce()
        self.name, self.pending_state = "all_reduce", {}

    def choose(self, reducer: Reducer) -> None:
        self.inner, self.name = reducer, reducer.name
        if self.pending_state:  # a resumed run's error feedback, once the method that keeps it is back
            reducer.load_state_dict(self.pending_state)

    def reduce(self, tensor, group, parts=None):
        return self.inner.reduce(tensor, group, parts)

    def wire_bytes(self, tensor, parts=None):
        return self.inner.wire_bytes(tensor, parts)

    def collectives(self, tensor, parts=None):
        return self.inner.collectives(tensor, parts)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.pending_state = state


def auto_compression(row, parameters: dict) -> AutoCompression:
    """The compressor registry's builder for `auto`."""
    return AutoCompression()


def probe_bandwidth(group, device: torch.device, repeats: int = 3) -> dict:
    """Collective over `group`: the all-reduce bus bandwidth in bytes per second (slowest rank)."""
    buffer = torch.zeros(PROBE_BYTES // 4, device=device)
    dist.all_reduce(buffer, group=group)  # connections made, buffers touched
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(buffer, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = torch.tensor([(time.perf_counter() - started) / repeats])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    ranks = dist.get_world_size(group)
    return {
        "probe_bytes": PROBE_BYTES,
        "probe_s": seconds.item(),
        "bandwidth_Bps": 2 * (ranks - 1) / ranks * PROBE_BYTES / max(seconds.item(), 1e-9),
    }


def _candidates() -> tuple[str, str]:
    """The settings `auto` may choose (`Compressor.auto_setting`): (error feedback, plain cast)."""
    settings = [(row.auto_setting, row.error_feedback) for row in compressors.ROWS if row.auto_setting is not None]
    return next(s for s, feedback in settings if feedback), next(s for s, feedback in settings if not feedback)


def decide(shapes: list[torch.Size], ranks: int, bandwidth: float, step_s: float, feedback_ok: bool) -> dict:
    """The method and the figures it was chosen by."""
    params = sum(math.prod(shape) for shape in shapes)
    comm_s = 2 * (ranks - 1) / ranks * 4 * params / bandwidth if ranks > 1 else 0.0
    compute_s = max(step_s - comm_s, 1e-6)
    feedback, cast = _candidates()
    chosen = reducer_for(feedback)
    assert isinstance(chosen, ErrorFeedback), feedback  # its row says error_feedback
    shrinks = sum(math.prod(s) for s in shapes if chosen.compresses(s))
    if comm_s <= SHARE * compute_s:
        choice, why = "none", f"the all-reduce would take {comm_s / compute_s:.1%} of compute (<= {SHARE:.0%})"
    elif feedback_ok and shrinks * 2 >= params:
        choice, why = (
            feedback,
            f"the all-reduce would take {comm_s / compute_s:.0%} of compute; "
            f"{shrinks / params:.0%} of the parameters are matrices it shrinks",
        )
    else:
        choice, why = cast, f"the all-reduce would take {comm_s / compute_s:.0%} of compute"
    return {
        "params": params,
        "estimated_comm_s": comm_s,
        "step_s": step_s,
        "compute_s": compute_s,
        "choice": choice,
        "reason": why,
    }
