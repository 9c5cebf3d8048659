"""The spawned side of the link calibration (`gradmesh.plan.link`): one rank joins the process
group over loopback, times every kind and size, and rank 0 hands the points to the parent."""

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradmesh import env, lifeline, stores
from gradmesh.plan.link import Job

ELEMENT_BYTES = 4  # float32, the gradients' usual wire type


def rank_main(rank: int, world: int, port: int, parent: int, job: Job, results: Any) -> None:
    """One spawned rank: join the group over loopback, time every kind and size, report (rank 0)."""
    lifeline.die_with(parent)
    env.keep_on_interface(stores.loopback_interface(), override=True)
    torch.set_num_threads(job.threads)
    timeout = timedelta(seconds=job.timeout_s)
    store = stores.client(stores.LOOPBACK, port, timeout, world_size=world)
    dist.init_process_group(job.backend, store=store, rank=rank, world_size=world, timeout=timeout)
    points = _measure(job, rank, world)
    dist.destroy_process_group()
    if rank == 0:
        results.put(points)
    results.close()
    results.join_thread()  # the points are in the pipe before this process goes
    # Not the interpreter's teardown: gloo's threads can abort it while it frees their tensors
    # (see lifeline.run_script), which would fail a calibration that succeeded.
    os._exit(0)


def _measure(job: Job, rank: int, world: int) -> dict[str, list[list[float]]]:
    """Per kind, [buffer bytes, lower-quartile seconds] at each size. The repeats go round every kind and
    size in turn, so a spell of load from other processes spreads over all points instead of
    bending the fit at the few it happened to hit."""
    calls = {(kind, size): _operation(kind, size, rank, world) for kind in job.kinds for size in job.sizes}
    for call, _ in calls.values():
        call()
    times: dict[tuple[str, int], list[float]] = {key: [] for key in calls}
    for _ in range(job.repeats):
        for key, (call, _) in calls.items():
            times[key].append(_slowest_rank_s(call))
    return {kind: [[calls[kind, s][1], _lower_quartile(times[kind, s])] for s in job.sizes] for kind in job.kinds}


def _lower_quartile(times: list[float]) -> float:
    """Low, because other processes only add time; not the minimum, which one call that ran while
    the machine was briefly quieter than ever would set (the fastest of fewer than 4 repeats)."""
    return sorted(times)[len(times) // 4]


def _slowest_rank_s(call: Callable[[], object]) -> float:
    dist.barrier()  # every rank starts together: a late starter's wait is not the link's time
    start = time.perf_counter()
    call()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _operation(kind: str, nbytes: int, rank: int, world: int) -> tuple[Callable[[], object], int]:
    """A call of `kind` on a buffer of about `nbytes` (whole float32 shards) and its exact bytes."""
    count = max(nbytes // ELEMENT_BYTES // world, 1) * world
    whole, shard = torch.zeros(count), torch.zeros(count // world)
    calls: dict[str, Callable[[], object]] = {
        "all_reduce": lambda: dist.all_reduce(whole),
        "all_gather": lambda: dist.all_gather_single(whole, shard),
        "reduce_scatter": lambda: dist.reduce_scatter_single(shard, whole),
        "broadcast": lambda: dist.broadcast(whole, src=0),
        "p2p": lambda: _one_way(whole, rank),
    }
    return calls[kind], count * ELEMENT_BYTES


def _one_way(buffer: Any, rank: int) -> None:
    """Rank 0 sends to rank 1; any other rank has no part in it and times nothing."""
    if rank == 0:
        dist.send(buffer, dst=1)
    elif rank == 1:
        dist.recv(buffer, src=0)
