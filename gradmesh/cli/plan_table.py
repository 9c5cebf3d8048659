"""The planner's answer for people (a ranked rich table, the winner and why) and for programs (plan.json)."""

import dataclasses
import os

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gradmesh import config as configuration
from gradmesh import env
from gradmesh.plan.hardware import Cluster
from gradmesh.plan.planner import Planned
from gradmesh.plan.predict import Machine, Prediction

MIB = 2**20


def machine_for(cfg: configuration.Config, nproc: int, device: str, price: float | None) -> Machine:
    from gradmesh.cli.memory import memory_room

    have, sharing, _ = memory_room(cfg, nproc, device)
    return Machine(
        nproc=nproc,
        nnodes=cfg.launch.nnodes,
        cores=os.cpu_count() or 1,
        memory_per_rank=None if have is None else have / sharing,
        cuda=device == "cuda",
        price_per_hour=price,
        omp_threads=env.omp_threads(),
    )


def cluster_machine(cluster: Cluster, price: float | None, memory_mb: float | None) -> Machine:
    """A hypothetical cluster as the planner's `Machine`: a GPU per rank, its memory unless
    `launch.memory_per_rank_mb` says otherwise."""
    return Machine(
        nproc=cluster.nproc,
        nnodes=cluster.nodes,
        cores=cluster.nproc,  # one worker per GPU: nothing shares a core
        memory_per_rank=memory_mb * MIB if memory_mb else cluster.device.memory,
        cuda=True,
        price_per_hour=price,
    )


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _row(rank: str, p: Prediction, machine: Machine) -> list[str]:
    memory = f"{p.peak_bytes / MIB:,.0f} MiB"
    if not p.fits and machine.memory_per_rank:
        memory += f" [red](+{(p.peak_bytes - machine.memory_per_rank) / MIB:,.0f} over)[/red]"
    return [
        rank,
        p.candidate.label.removeprefix("--strategy "),
        f"{p.step_s * 1000:,.1f}",
        f"{p.samples_per_s:,.0f}",
        f"{p.speedup:.2f}x ({p.efficiency:.0%})",
        memory,
        _duration(p.train_s),
        "" if p.cost is None else f"{p.cost:,.2f}",
        p.bottleneck,
    ]


def print_plan(planned: Planned, machine: Machine, top: int) -> None:
    # No emoji codes: "--model hf:llama: ..." in a reason is not a :llama: picture.
    console = Console(emoji=False)
    if not console.is_terminal:  # a log or a pipe: rows whole rather than wrapped at 80 columns
        console = Console(width=160, emoji=False)
    table = Table(title=f"gradmesh plan: {machine.world} worker(s), {planned.samples:,} samples", header_style="bold")
    for name in ("#", "plan", "step ms", "samples/s", "speed-up", "memory/rank", "to train", "cost", "bottleneck"):
        table.add_column(name, justify="left" if name in ("plan", "bottleneck") else "right")
    fitting = [p for p in planned.ranked if p.fits]
    for i, p in enumerate(planned.ranked[:top]):
        table.add_row(*_row(str(i + 1) if p.fits else "-", p, machine))
    console.print(table)
    if fitting:
        console.print(why_best(fitting))
    elif planned.ranked:
        console.print("[red]no candidate fits in memory[/red]: the table shows by how much each misses")
    for candidate, reason in planned.refused:
        console.print(f"[dim]not a candidate: {escape(candidate.label)}: {escape(reason)}[/dim]")
    if planned.hosts is not None:
        console.print(f"[dim]hosts: {planned.hosts.describe()}; each host as this machine is calibrated (--link)[/dim]")
    if planned.hardware is not None:
        console.print(f"[dim]hypothetical: {planned.hardware.describe()}; nothing calibrated (--hardware)[/dim]")
        return
    source = "cached" if planned.cached else "measured now"
    console.print(f"[dim]calibration {source}: {planned.cache} (--refresh to measure again)[/dim]")


def why_best(fitting: list[Prediction]) -> str:
    """One line: the winner, and the part of the runner-up's step that makes the difference."""
    best = fitting[0]
    if len(fitting) == 1:
        return f"best: {best.candidate.label} (the only candidate that fits)"
    second = fitting[1]
    if second.step_s <= best.step_s:
        gain = 1 - second.step_s / best.step_s
        return (
            f"best: {best.candidate.label}: {second.candidate.label} is predicted {gain:.1%} faster, closer than "
            f"the calibration tells apart, and {best.candidate.label} changes fewer settings"
        )
    gaps = {k: second.parts.get(k, 0.0) - best.parts.get(k, 0.0) for k in set(best.parts) | set(second.parts)}
    part = max(gaps, key=lambda k: gaps[k])
    return (
        f"best: {best.candidate.label}, {second.step_s / best.step_s:.2f}x faster than the runner-up "
        f"{second.candidate.label}, which spends {gaps[part] * 1000:.1f} ms more per step on {part}"
    )


def to_json(planned: Planned, machine: Machine) -> dict:
    def entry(p: Prediction) -> dict:
        found = dataclasses.asdict(p)
        found["candidate"] = {**dataclasses.asdict(p.candidate), "label": p.candidate.label}
        found["bottleneck"] = p.bottleneck
        return found

    return {
        "machine": dataclasses.asdict(machine),
        "samples": planned.samples,
        "single_worker_step_s": planned.single_step_s,
        "calibration": None if planned.cache is None else str(planned.cache),
        "hardware": None if planned.hardware is None else _hardware(planned.hardware),
        "link": None
        if planned.hosts is None
        else {"nodes": planned.hosts.nodes, **dataclasses.asdict(planned.hosts.inter)},
        "ranked": [entry(p) for p in planned.ranked],
        "refused": [{"label": c.label, "reason": why} for c, why in planned.refused],
    }


def _hardware(cluster: Cluster) -> dict:
    """What a hypothetical plan assumes: the device's table row, the cluster's shape, the link between nodes."""
    return {
        "described": cluster.describe(),
        "device": dataclasses.asdict(cluster.device),
        "nodes": cluster.nodes,
        "nproc": cluster.nproc,
        "inter_node_link": dataclasses.asdict(cluster.inter),
    }
