"""What one worker's computation costs, measured on this machine: the planner's compute input.

The configured model (built for real, on a small copy of its data) runs forward and backward
passes at two micro-batch sizes with the thread count a worker would get, and the time is
fitted as `fixed + per_sample x samples` (a pass has a per-call cost, kernel launches and
Python, that does not shrink with the batch). The optimizer's step is timed over all the
parameters and kept per parameter, since sharded strategies step a share of them. The bytes
autograd saves per sample come from the memory guard's meter (`gradmesh.loop.memory_guard`),
and the resident memory of a process that has built the model (torch itself, the data) from
the operating system, so a prediction of peak memory has something to stand on besides the
model state. Medians of a few repeats after a warm-up keep a busy neighbour's noise out.
"""

import dataclasses
import multiprocessing
import resource
import statistics
import time
from dataclasses import dataclass

import torch

from gradmesh.config import Config
from gradmesh.errors import UsageError

REPEATS = 5
CALIBRATION_SAMPLES = 20_000
"""The click log of a recsys calibration (its default is 3 x 10^6 samples: minutes to make)."""


@dataclass(frozen=True)
class ComputeProfile:
    threads: int
    fixed_s: float
    """Seconds of one forward and backward pass that do not grow with its samples."""
    per_sample_s: float
    optimizer_s_per_param: float
    add_s_per_param: float
    """Adding one gradient into another (a server summing its workers' pushes)."""
    activation_bytes_per_sample: float
    params: int
    base_bytes: int
    """Resident bytes of a process with torch, the data and the model, before training."""
    boundary_bytes_per_sample: float = 0.0
    """The largest activation passed between two pipeline units, per sample (0: not cut-able)."""
    layers: int = 1
    """Pipeline units between the first and the last (GPT's blocks)."""
    sweep_s_per_param: float = 0.0
    """A pass over every gradient outside the arithmetic (flattening into a bucket, the clipping
    norm), per parameter: the part of the loop's own work that grows with the gradients a rank holds."""
    table_grad_s: float = 0.0
    """Seconds of each pass spent on the sparse tables' whole-table gradients: what a worker whose
    tables live on parameter servers does not do (it sends the rows it looked up instead)."""

    def pass_s(self, samples: float) -> float:
        """Forward and backward of one micro-batch of `samples`."""
        return self.fixed_s + self.per_sample_s * samples if samples > 0 else 0.0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "ComputeProfile":
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


def calibration_config(cfg: Config) -> Config:
    """The same model on a small copy of its data (recsys generates its click log)."""
    samples = min(cfg.model.samples, max(CALIBRATION_SAMPLES, 4 * cfg.train.global_batch_size))
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, samples=samples))


def _median_pass_s(workload, batch) -> float:
    times = []
    for _ in range(REPEATS + 1):  # the first pass allocates and warms caches
        started = time.perf_counter()
        workload.loss_fn(workload.model, batch).mean().backward()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def _activation_bytes(workload, batch) -> float:
    from gradmesh.loop.memory_guard import ActivationMeter

    meter = ActivationMeter(lambda: workload.model)
    with meter.around_forward(len(batch[0])):
        loss = workload.loss_fn(workload.model, batch).mean()
    loss.backward()
    return meter.per_sample or 0.0


def unit_boundaries(workload, batch) -> tuple[float, int]:
    """(largest bytes per sample handed from one pipeline unit to the next, inner units)."""
    from gradmesh.parallel.pipeline_units import pipeline_units

    try:
        units = pipeline_units(workload.model)
    except UsageError:
        return 0.0, 1
    seen: list[int] = []
    hooks = [
        workload.model.get_submodule(unit[-1]).register_forward_hook(
            lambda module, args, out: seen.append(out.numel() * out.element_size())
        )
        for unit in units[:-1]
    ]
    try:
        with torch.no_grad():
            workload.loss_fn(workload.model, batch)
    finally:
        for hook in hooks:
            hook.remove()
    return (max(seen) / len(batch[0]) if seen else 0.0), max(len(units) - 2, 1)


def _optimizer_s_per_param(workload, cfg: Config) -> float:
    from gradmesh.optim import optimizer_spec

    optimizer_class, kwargs = workload.optimizer or optimizer_spec(cfg.train)
    optimizer = optimizer_class(workload.model.parameters(), **kwargs)
    times = []
    for _ in range(REPEATS + 1):
        started = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - started)
    params = sum(p.numel() for p in workload.model.parameters())
    return statistics.median(times[1:]) / max(params, 1)


def _add_s_per_param(params: int) -> float:
    total, push = torch.zeros(max(params, 1)), torch.ones(max(params, 1))
    times = []
    for _ in range(REPEATS + 1):
        started = time.perf_counter()
        total.add_(push)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:]) / max(params, 1)


def _fit(times: dict[int, float]) -> tuple[float, float]:
    """Least-squares (fixed, per_sample), neither negative."""
    sizes = sorted(times)
    mean_n, mean_t = statistics.fmean(sizes), statistics.fmean(times.values())
    spread = sum((n - mean_n) ** 2 for n in sizes)
    slope = sum((n - mean_n) * (times[n] - mean_t) for n in sizes) / spread if spread else mean_t / mean_n
    slope = max(slope, 0.0)
    return max(mean_t - slope * mean_n, 0.0), slope


def measure_compute(cfg: Config, threads: int, sizes: tuple[int, ...]) -> ComputeProfile:
    """Time the configured model at micro-batches of `sizes` samples on `threads` threads."""
    from gradmesh import workloads
    from gradmesh.data import fetch

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        workload = workloads.build(calibration_config(cfg), torch.device("cpu"))
        batches = {n: fetch(workload.train_data, list(range(n))) for n in set(sizes)}
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        fixed, per_sample = _fit({n: _median_pass_s(workload, batch) for n, batch in batches.items()})
        smallest = batches[min(sizes)]
        boundary, layers = unit_boundaries(workload, smallest)
        params = sum(p.numel() for p in workload.model.parameters())
        return ComputeProfile(
            threads=threads,
            fixed_s=fixed,
            per_sample_s=per_sample,
            optimizer_s_per_param=_optimizer_s_per_param(workload, cfg),
            add_s_per_param=_add_s_per_param(params),
            activation_bytes_per_sample=_activation_bytes(workload, smallest),
            params=params,
            base_bytes=base,
            boundary_bytes_per_sample=boundary,
            layers=layers,
            sweep_s_per_param=_sweep_s_per_param(workload),
            table_grad_s=_table_grad_s(workload, smallest),
        )
    finally:
        torch.set_num_threads(saved)


def _sweep_s_per_param(workload) -> float:
    """DDP's copy of the gradients into its buckets and the clip's norm, timed on the gradients the
    passes above left (a stand-in for every whole-gradient pass of a step besides the optimizer)."""
    grads = [p.grad for p in workload.model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    times = []
    for _ in range(REPEATS + 1):
        started = time.perf_counter()
        torch.cat([g.reshape(-1) for g in grads])
        torch.nn.utils.clip_grad_norm_(workload.model.parameters(), float("inf"))
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:]) / sum(g.numel() for g in grads)


def _table_grad_s(workload, batch) -> float:
    """A pass with the sparse tables' weights held fixed, against one with them trained."""
    from gradmesh.parallel.ps import sparse_tables

    tables = [table.weight for _, table in sparse_tables(workload.model)]
    if not tables:
        return 0.0
    whole = _median_pass_s(workload, batch)
    for weight in tables:
        weight.requires_grad_(False)
        weight.grad = None
    try:
        return max(whole - _median_pass_s(workload, batch), 0.0)
    finally:
        for weight in tables:
            weight.requires_grad_(True)


def _co_running_work(threads: int, results) -> None:
    """A fixed mix of a matrix product and an element-wise pass; its median seconds to `results`."""
    torch.set_num_threads(threads)
    a, b, x = torch.randn(512, 512), torch.randn(512, 512), torch.randn(4096, 1024)
    times = []
    for _ in range(REPEATS + 1):
        started = time.perf_counter()
        for _ in range(10):
            a @ b
            torch.nn.functional.gelu(x).sum()
        times.append(time.perf_counter() - started)
    results.put(statistics.median(times[1:]))


def _slowest_of(processes: int, threads: int) -> float:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=_co_running_work, args=(threads, results), daemon=True) for _ in range(processes)]
    for worker in workers:
        worker.start()
    try:
        return max(results.get(timeout=120) for _ in workers)
    finally:
        for worker in workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()


def co_running(processes: int, threads: int) -> float:
    """How much slower each of `processes` workers computes when all run at once than one alone:
    cores shared as hyperthreads, caches and memory bandwidth. A property of the machine, not
    of the model, so a fixed mix of work measures it."""
    if processes <= 1:
        return 1.0
    return max(1.0, _slowest_of(processes, threads) / _slowest_of(1, threads))
