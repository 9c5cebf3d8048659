"""Timeline: the phases and collectives of `--trace-steps A:B` as RUN_DIR/trace.json.

Chrome's trace event format (open in https://ui.perfetto.dev or chrome://tracing): one process
track per rank, with threads for the steps, the phases and the collectives in flight. Each rank
records its own events (`StepClock`); at the end rank 0 gathers them on the monitoring group.
Times are wall-clock microseconds since the earliest event, so the ranks line up.
"""

import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gradmesh.files import atomic_write

TRACKS = ("steps", "phases", "collectives")


def gather_and_write(events: list[dict], rank: int, world_size: int, group, path: Path | None) -> None:
    """Collective over `group`; rank 0 writes the file."""
    # gather_object fills the slots with each rank's `events` (a list[dict]).
    everyone: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(events, everyone, dst=0, group=group)
    if rank != 0 or path is None:
        return
    assert everyone is not None  # made above on rank 0
    start = min((e["ts"] for rank_events in everyone for e in rank_events), default=0.0)
    trace = []
    for r, rank_events in enumerate(everyone):
        trace.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": r, "args": {"sort_index": r}})
        for tid, track in enumerate(TRACKS):
            trace.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": track}})
        for event in rank_events:
            trace.append(dict(event, pid=r, tid=TRACKS.index(event["tid"]), ts=event["ts"] - start))
    atomic_write(path, json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
