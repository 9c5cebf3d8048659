"""One rank of a pipeline benchmark (launched by bench_pipeline.py through `gradmesh run`).

modes:
  schedule  stages of fixed compute time (sleeps, so 4 ranks on 2 cores do not contend for
            cores; the schedule, transfers and autograd are real): step time, busy time, and
            the peak of activation bytes held for backward
  cut       an unbalanced model with real compute (four wide layers, then four cheap ones):
            step time with the balanced cut and with the equal-layer cut
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import gradmesh
from gradmesh.parallel.pipeline import Pipeline, PipelineOptions, pipeline_units
from gradmesh.plan.partition import equal_cut

BUSY = [0.0]
BACKWARD_START = [0.0]


class Pause(torch.autograd.Function):
    """Identity whose forward and backward take a fixed time (stand-in for a stage's compute).

    Its backward runs first in the layer's backward, so it also marks when that began."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        BACKWARD_START[0] = time.perf_counter()
        time.sleep(ctx.backward_s)
        return grad, None, None


class Enter(torch.autograd.Function):
    """Identity at a layer's input; its backward runs last in the layer's backward. `anchor` (a
    parameter) makes autograd run it on the first stage too, whose input needs no gradient."""

    @staticmethod
    def forward(ctx, x, anchor):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        BUSY[0] += time.perf_counter() - BACKWARD_START[0]
        return grad, None


class TimedLayer(nn.Module):
    """Linear + tanh + a fixed pause; BUSY accumulates its whole forward and backward time."""

    def __init__(self, width: int, forward_s: float, backward_s: float):
        super().__init__()
        self.linear, self.forward_s, self.backward_s = nn.Linear(width, width), forward_s, backward_s

    def forward(self, x):
        tic = time.perf_counter()
        x = Enter.apply(x, self.linear.bias)
        out = Pause.apply(torch.tanh(self.linear(x)), self.forward_s, self.backward_s)
        BUSY[0] += time.perf_counter() - tic
        return out


class LiveSaved(torch.autograd.graph.saved_tensors_hooks):
    """Bytes autograd holds for backward right now, and their peak (parameters excluded)."""

    def __init__(self, params: set[int]):
        self.live = self.peak = 0
        owner = self

        class Held:
            def __init__(self, tensor):
                self.tensor, self.bytes = tensor, tensor.numel() * tensor.element_size()
                owner.live += self.bytes
                owner.peak = max(owner.peak, owner.live)

            def __del__(self):
                owner.live -= self.bytes

        def pack(tensor):
            return tensor if tensor.data_ptr() in params else Held(tensor)

        super().__init__(pack, lambda held: held if isinstance(held, torch.Tensor) else held.tensor)


def criterion(out, target):
    return F.cross_entropy(out, target, reduction="none")


def build(model, session, schedule, microbatches, batch, width, split):
    example = (torch.randn(batch // microbatches, width), torch.randint(0, width, (batch // microbatches,)))
    options = PipelineOptions(criterion, schedule=schedule, microbatches=microbatches, split=split, example=example)
    return Pipeline(model, session.topology, options)


def timed_steps(pipe, batch, width, steps):
    data = (torch.randn(batch, width), torch.randint(0, width, (batch,)), torch.ones(batch))
    for _ in range(2):  # the first step also infers stage shapes
        pipe.step(*data)
    dist.barrier()
    BUSY[0] = 0.0
    tic = time.perf_counter()
    for _ in range(steps):
        pipe.step(*data)
    dist.barrier()
    elapsed, busy = (time.perf_counter() - tic) / steps, BUSY[0] / steps
    params = {p.data_ptr() for p in pipe.full.parameters()}
    saved = LiveSaved(params)
    with saved:
        pipe.step(*data)
    return elapsed, busy, saved.peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("schedule", "cut"), required=True)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    session = gradmesh.init(mesh={"pp": int(os.environ.get("WORLD_SIZE", 1))}, seed=0)
    p, rows = session.world_size, {}
    if args.mode == "schedule":
        width, per_microbatch = 64, 4
        batch = per_microbatch * args.microbatches
        model = nn.Sequential(*[TimedLayer(width, 0.03, 0.06) for _ in range(p)])
        pipe = build(model, session, args.schedule, args.microbatches, batch, width, ())
        step_s, busy_s, peak = timed_steps(pipe, batch, width, args.steps)
        rows = {"step_s": step_s, "busy_s": busy_s, "activation_peak_bytes": peak}
    else:
        width, batch = 256, 4096  # weights that fit in a core's L2: the two ranks then scale
        for split in ("balanced", "equal"):
            torch.manual_seed(0)
            heavy = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(4)]
            light = [nn.LayerNorm(width), nn.Tanh(), nn.LayerNorm(width), nn.Tanh()]
            model = nn.Sequential(*heavy, *light)
            points = () if split == "balanced" else tuple(names_at(model, p)[1:])
            pipe = build(model, session, args.schedule, args.microbatches, batch, width, points)
            step_s, _, _ = timed_steps(pipe, batch, width, args.steps)
            rows[split] = {"step_s": step_s, "stages": [s["units"] for s in pipe.plan["stages"]],
                           "bottleneck": pipe.plan["bottleneck"]}
    with open(f"{args.out}.rank{session.rank}", "w") as f:
        json.dump(rows, f)
    session.close()


def names_at(model, stages):
    names = [u[0] for u in pipeline_units(model)]
    return [names[i] for i in equal_cut(len(names), stages)]


if __name__ == "__main__":
    main()
    sys.exit(0)
