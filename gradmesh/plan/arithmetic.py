"""Compression's own arithmetic, measured once per model shape: what a method costs the cores
beside the bytes it saves on the wire.

A cast narrows and widens every gradient; PowerSGD multiplies each matrix by its warm-start Q,
orthogonalises P and keeps the error for the next step; top-k selects and scatters. On a CPU that
arithmetic can cost as much as the bytes it saves, so leaving it out ranks compression ahead of
plans that are faster. Each method's reducer (the job's own, `gradmesh.comm.compress.reducer_for`)
runs on a gradient of the model's shapes in one spawned process, on a one-rank gloo group whose
collectives move nothing (a file store: no listener); past its plain start-up steps, its median
time beyond the plain mean's is kept per method. Its collectives at N ranks are costed from the
link instead (`Reducer.wire_bytes` and `Reducer.collectives`).
"""

import math
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Sequence

WARMUP = 3
"""Calls before timing: past every method's default plain start (PowerSGD's start=2)."""
REPEATS = 7


def method_of(compression: str) -> str:
    """The key a compression's arithmetic is kept under (its method, whatever its parameters)."""
    return "compress:" + compression.split(":")[0]


def measure_compression(
    shapes: dict[str, tuple[int, ...]], compressions: Sequence[str], threads: int
) -> dict[str, float]:
    """{method_of(c): seconds one reduction of the whole gradient spends in c's arithmetic}."""
    wanted = [c for c in compressions if c not in ("none", "auto")]
    if not wanted or not shapes:
        return {}
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="gradmesh-arithmetic-") as folder:
        store = os.path.join(folder, "store")
        worker = context.Process(target=_time_methods, args=(shapes, wanted, threads, store, results), daemon=True)
        worker.start()
        try:
            found = results.get(timeout=300)
        finally:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()
    return {method_of(c): seconds for c, seconds in found.items()}


def _time_methods(shapes: dict, compressions: list[str], threads: int, store_path: str, results) -> None:
    """The spawned side: each method's median seconds beyond the plain mean's, to `results`."""
    import torch
    import torch.distributed as dist

    from gradmesh.comm.compress import reducer_for
    from gradmesh.comm.reducer import MeanAllReduce

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 1), rank=0, world_size=1)
    parts = [(name, torch.Size(shape)) for name, shape in shapes.items()]
    gradient = torch.randn(sum(math.prod(shape) for shape in shapes.values()))
    plain = _median_s(MeanAllReduce(), gradient, parts)
    found = {c: max(_median_s(reducer_for(c), gradient, parts) - plain, 0.0) for c in compressions}
    dist.destroy_process_group()
    results.put(found)


def _median_s(reducer, gradient, parts) -> float:
    import torch.distributed as dist

    times = []
    for _ in range(WARMUP + REPEATS):
        buffer = gradient.clone()
        started = time.perf_counter()
        reducer.average(buffer, dist.group.WORLD, parts)
        times.append(time.perf_counter() - started)
    return statistics.median(times[WARMUP:])
