"""The decisions issue 27 names, made by the planner from a stated calibration (written to the
calibration cache, as a measured one would be): the wide model between hosts on a 200 Mbit/s link
chooses compression, and a recommendation model with a million rows per table chooses a
table-sharding strategy over ddp. benchmarks/bench_plan.py measures both for real
(docs/benchmarks.md#planner); here the arithmetic of the choice is checked, in milliseconds.

The stated calibration is this machine's order of magnitude: a pass of `fixed + per_sample x n`
seconds, gloo on loopback at 1 GB/s with 100 us start-ups, no other overhead."""

import json
import math

import pytest
from helpers import gradmesh

from gradmesh import config, workloads
from gradmesh.plan.calibration import Calibration, calibration_place
from gradmesh.plan.compute import ComputeProfile
from gradmesh.plan.hardware import Link
from gradmesh.plan.link import LinkFit, LinkProfile
from gradmesh.plan.planner import plan
from gradmesh.plan.predict import Machine

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")
WIDE = {"model": {"n_embd": 512, "n_head": 8}, "train": {"global_batch_size": 32}}
MILLION_ROWS = {"model": {"name": "recsys", "rows": 1_000_000, "samples": 20_000}, "train": {"global_batch_size": 510}}  # 3 ranks, or 2 workers and a server


def _stated(cfg: config.Config, machine: Machine, per_sample_s: float, boundary: float = 4096.0) -> None:
    """Writes the stated calibration where `plan` looks for this job's."""
    params = _params(cfg)
    threads = {machine.threads(machine.nproc), machine.threads(1)}
    profile = {t: ComputeProfile(threads=t, fixed_s=0.005, per_sample_s=per_sample_s, optimizer_s_per_param=2e-9,
                                 add_s_per_param=5e-10, activation_bytes_per_sample=1e5, params=params,
                                 base_bytes=300 * 2**20, boundary_bytes_per_sample=boundary, layers=4)
               for t in threads}  # fmt: skip
    link = LinkProfile(2, "gloo", 1, {kind: LinkFit(1e-4, 1e-9) for kind in KINDS})
    overheads = {"loop": 0.001, "compress:powersgd": 0.01, "compress:fp16": 0.002}
    path = calibration_place(cfg, machine)[2]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(Calibration(profile, {2: link}, overheads).to_json()))


def _params(cfg: config.Config) -> int:
    return sum(math.prod(shape) for shape in workloads.model_shapes(cfg).values())


def test_the_wide_model_between_hosts_on_a_slow_link_chooses_compression():
    """4 x 8.4M fp32 gradient bytes over 200 Mbit/s is over a second a step, a hundred times the
    pass: compression wins, and the low-rank method (a few hundred KB) over the half-width cast."""
    cfg = config.build([WIDE])
    machine = Machine(nproc=1, nnodes=2, cores=2)
    _stated(cfg, machine, per_sample_s=0.002, boundary=4.0 * cfg.model.block_size * cfg.model.n_embd)
    planned = plan(cfg, machine, samples=3200, inter=Link(bandwidth=200e6 / 8, latency_s=50e-6))
    assert planned.cached and planned.hosts is not None
    best = planned.ranked[0]
    assert best.candidate.compression.startswith("powersgd"), best.candidate.label
    by_label = {p.candidate.label: p for p in planned.ranked}
    plain = by_label["--strategy ddp"]
    # the uncompressed all-reduce: 2(N-1)/N x 4P bytes at the link's speed, plus its start-ups
    gradient = 4.0 * _params(cfg)
    assert plain.parts["comm"] == pytest.approx(gradient / (200e6 / 8), rel=0.05)
    assert by_label["--strategy ddp --compression fp16"].parts["comm"] == pytest.approx(plain.parts["comm"] / 2, rel=0.05)
    # the same job on one host is compute-bound, and keeps the gradients as they are
    one_host = Machine(nproc=2, nnodes=1, cores=2)
    _stated(cfg, one_host, per_sample_s=0.002)
    assert plan(cfg, one_host, samples=3200).ranked[0].candidate.compression == "none"


def test_a_million_rows_per_table_chooses_a_table_sharding_strategy_over_ddp():
    """8 tables of 10^6 x 16 fp32 rows: ddp all-reduces and steps 512 MB of table gradients a
    step; the servers (or the ranks owning the rows, under tables) move and step only the rows a
    batch touched (510 x 8 here)."""
    cfg = config.build([MILLION_ROWS])
    machine = Machine(nproc=3, nnodes=1, cores=2)
    _stated(cfg, machine, per_sample_s=2e-5)
    planned = plan(cfg, machine, samples=510 * 100)
    best = planned.ranked[0]
    assert best.candidate.strategy in ("tables", "hybrid", "ps"), best.candidate.label
    ddp = next(p for p in planned.ranked if p.candidate.label == "--strategy ddp")
    assert ddp.step_s > 5 * best.step_s and ddp.bottleneck.startswith(("communication", "optimizer"))


def test_link_needs_nodes_or_hardware(cli):
    result = cli("plan", "--link", "200mbit")
    assert result.returncode == 2 and "--nodes 2 or more" in result.stderr and "Traceback" not in result.stderr
    bad = gradmesh("plan", "--nodes", "2", "--nproc", "1", "--link", "fast")
    assert bad.returncode == 2 and "--link must be" in bad.stderr
