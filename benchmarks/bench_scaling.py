"""Benchmark: the planner's cost model on hypothetical clusters against published scaling results.

    .venv/bin/python benchmarks/bench_scaling.py     # prints the tables, writes benchmarks/results/scaling.json

Nothing trains: each published workload is described by its numbers (parameters, forward FLOPs
per sample, batch per GPU, precision; the source of each is in `source`), and its step is built by
the same registry rows and cost functions `gradmesh plan --hardware` uses (`predict.apply_rows`
over a `hardware.Cluster`), on the paper's hardware from the table with one efficiency factor per
device, never tuned per row. Scaling efficiency is throughput per GPU at N GPUs over that of one
GPU (weak scaling: the batch per GPU held). The model of the step hides gradient reduction behind
half of backward on GPUs (`costs.OVERLAP_CUDA`, an assumption); the "no overlap" column sets it
to 0, bounding the answer from the other side. The ZeRO rows set the registry's model-state
formulas beside the paper's Table 1. docs/planning.md#checked-against-published-results has the
table with its citations and what the simulation leaves out.
"""

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from unittest import mock

from rich.console import Console
from rich.table import Table

from gradmesh.parallel import registry
from gradmesh.plan import costs
from gradmesh.plan.compute import ComputeProfile
from gradmesh.plan.flops import update_s_per_param
from gradmesh.plan.hardware import DEVICES, GB, Device, Link, cluster
from gradmesh.plan.predict import apply_rows

HERE = Path(__file__).parent
UBER = dict(device=DEVICES["p100"], per_node=4, inter=Link(bandwidth=25 * GB / 8, latency_s=10e-6))
DGX1_V100 = dict(device=DEVICES["v100-32g"], per_node=8, inter=Link(bandwidth=100 * GB / 8, latency_s=10e-6))
DGX2H = dict(device=DEVICES["v100-32g"], per_node=16, inter=Link(bandwidth=100 * GB, latency_s=10e-6))


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A published training job, by its numbers."""

    name: str
    params: float
    forward_flops: float
    """Per sample (2 FLOPs per multiply-add)."""
    batch: int
    """Samples per GPU (per model-parallel group under tensor parallelism)."""
    half: bool
    """Mixed precision: tensor-core peak, 2-byte gradients and activations on the wire."""
    hardware: dict
    gpus: int
    tp: int = 1
    layers: int = 1
    boundary_bytes: float = 0.0
    """Per sample, one block's output (what tensor parallelism all-reduces)."""
    published: str
    source: str


def gpt_forward_flops(layers: int, hidden: int, seq: int, vocab: int) -> float:
    """Per sequence: 24·s·l·h²·(1 + s/6h) + 2·s·h·V (Narayanan et al., SC'21, eq. 3, one forward pass)."""
    return 24 * seq * layers * hidden**2 * (1 + seq / (6 * hidden)) + 2 * seq * hidden * vocab


HOROVOD = "Sergeev & Del Balso, arXiv:1802.05799 (2018); 128 servers x 4 Pascal GPUs, 25 Gbit/s RoCE"
TORCHVISION = "params and GMACs: torchvision's model table"
WORKLOADS = (
    Workload(name="Horovod Inception V3", params=27.2e6, forward_flops=2 * 5.71e9, batch=64, half=False,
             hardware=UBER, gpus=512, published="~90%", source=f"{HOROVOD}; {TORCHVISION}; batch 64 assumed"),
    Workload(name="Horovod ResNet-101", params=44.5e6, forward_flops=2 * 7.80e9, batch=64, half=False,
             hardware=UBER, gpus=512, published="~90%", source=f"{HOROVOD}; {TORCHVISION}; batch 64 assumed"),
    Workload(name="Horovod VGG-16", params=138.4e6, forward_flops=2 * 15.47e9, batch=64, half=False,
             hardware=UBER, gpus=512, published="68%", source=f"{HOROVOD}; {TORCHVISION}; batch 64 assumed"),
    Workload(name="PyTorch DDP ResNet-50", params=25.6e6, forward_flops=2 * 4.09e9, batch=32, half=False,
             hardware=DGX1_V100, gpus=256, published="near-linear (no figure confirmed)",
             source="Li et al., VLDB 2020, abstract; hardware and batch assumed, not confirmed from the paper"),
    Workload(name="PyTorch DDP BERT-large", params=340e6, forward_flops=2 * 340e6 * 128, batch=32, half=False,
             hardware=DGX1_V100, gpus=256, published="near-linear (no figure confirmed)",
             source="Li et al., VLDB 2020, abstract; model size, sequence 128, hardware and batch assumed"),
    Workload(name="Megatron-LM 8.3B, 8-way tensor parallel", params=8.3e9,
             forward_flops=gpt_forward_flops(72, 3072, 1024, 51200), batch=8, half=True, hardware=DGX2H,
             gpus=512, tp=8, layers=72, boundary_bytes=1024 * 3072 * 2, published="76%",
             source="Shoeybi et al., arXiv:1909.08053 (2019): abstract and Table 1; 32 DGX-2H, 64-way data parallel"),
)  # fmt: skip
MEGATRON_BASELINE = dict(params=1.2e9, forward_flops=gpt_forward_flops(40, 1536, 1024, 51200))
"""The 1.2B model on one GPU that Megatron-LM's weak scaling is measured against (its Table 1)."""


def step_s(work: Workload, gpus: int) -> float:
    """One step of `work` on `gpus` GPUs of its hardware: the registry rows' cost functions."""
    device: Device = work.hardware["device"]
    per_node = min(work.hardware["per_node"], gpus)
    nodes = cluster(device, math.ceil(gpus / per_node), per_node, work.hardware["inter"])
    peak = device.peak_half if work.half else device.peak_fp32
    profile = ComputeProfile(
        threads=1, fixed_s=0.0, per_sample_s=3 * work.forward_flops / (peak * device.efficiency),
        optimizer_s_per_param=update_s_per_param(device, slots=2), add_s_per_param=0.0, activation_bytes_per_sample=0.0,
        params=int(work.params), base_bytes=0, boundary_bytes_per_sample=work.boundary_bytes,
        layers=work.layers,
    )  # fmt: skip
    tp = min(work.tp, gpus)
    mesh = {"dp": gpus // tp, "tp": tp} if tp > 1 else {"dp": gpus}
    options = costs.Options(cuda=True, tp_params=int(work.params) if tp > 1 else 0)
    step = costs.Step(compute=profile, network=nodes, options=options, micro_samples=work.batch, micro=1,
                      params=work.params, grad_bytes_per_param=2 if work.half else 4)  # fmt: skip
    return sum(apply_rows(step, registry.resolve("ddp", mesh)).parts.values())


def efficiency(work: Workload) -> float:
    """Throughput per GPU at `work.gpus` over one GPU's; Megatron-LM's: FLOP/s per GPU over its 1.2B baseline's."""
    if work.tp == 1:
        return step_s(work, 1) / step_s(work, work.gpus)
    baseline = replace(work, tp=1, layers=1, boundary_bytes=0.0, **MEGATRON_BASELINE)
    per_gpu = work.forward_flops * work.batch / work.tp / step_s(work, work.gpus)
    return per_gpu / (baseline.forward_flops * baseline.batch / step_s(baseline, 1))


def zero_rows(psi: float = 7.5e9, nd: int = 64) -> list[dict]:
    """ZeRO's Table 1 row (Rajbhandari et al., SC'20: Ψ = 7.5B, Nd = 64, mixed-precision Adam, K = 12)
    beside the registry's fp32 formulas for the same Ψ and Nd (AdamW: two fp32 slots)."""
    size, gb = registry.ModelSize(params=int(psi)), 1e9
    paper = {"baseline": 16 * psi, "Pos": (4 + 12 / nd) * psi, "Pos+g": (2 + 14 / nd) * psi, "Pos+g+p": 16 * psi / nd}
    published = {"baseline": 120, "Pos": 31.4, "Pos+g": 16.6, "Pos+g+p": 1.9}
    ours = {"baseline": "ddp", "Pos": "zero1", "Pos+g+p": "fsdp"}
    return [
        {"stage": stage, "published_gb": published[stage], "paper_formula_gb": paper[stage] / gb,
         "registry_row": ours.get(stage),
         "registry_gb": registry.STRATEGIES[ours[stage]].state_bytes(size, nd) / gb if stage in ours else None}
        for stage in paper
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "results" / "scaling.json"))
    args = parser.parse_args()
    rows = []
    for work in WORKLOADS:
        with mock.patch.object(costs, "OVERLAP_CUDA", 0.0):
            bare = efficiency(work)
        rows.append({"workload": work.name, "gpus": work.gpus, "published": work.published,
                     "simulated": efficiency(work), "simulated_no_overlap": bare, "source": work.source})  # fmt: skip
    table = Table(title="Scaling efficiency: published against simulated", header_style="bold")
    for name in ("workload", "GPUs", "published", "simulated", "no overlap"):
        table.add_column(name, justify="left" if name == "workload" else "right")
    for r in rows:
        table.add_row(r["workload"], str(r["gpus"]), r["published"], f"{r['simulated']:.0%}",
                      f"{r['simulated_no_overlap']:.0%}")  # fmt: skip
    memory = Table(title="ZeRO model-state memory per GPU, 7.5B parameters on 64 GPUs (GB)", header_style="bold")
    for name in ("stage", "published", "paper's formula", "registry (fp32)"):
        memory.add_column(name, justify="right")
    zero = zero_rows()
    for z in zero:
        ours = "-" if z["registry_gb"] is None else f"{z['registry_gb']:.1f} ({z['registry_row']})"
        memory.add_row(z["stage"], f"{z['published_gb']:g}", f"{z['paper_formula_gb']:.1f}", ours)
    console = Console(width=140)
    console.print(table)
    console.print(memory)
    devices = {name: {"efficiency": d.efficiency, "source": d.efficiency_source} for name, d in DEVICES.items()}
    Path(args.out).write_text(json.dumps({"scaling": rows, "zero": zero, "devices": devices}, indent=1) + "\n")


if __name__ == "__main__":
    main()
