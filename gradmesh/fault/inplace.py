"""In-place recovery's membership protocol over the job's c10d store.

The launcher (`gradmesh.launch.inplace`) is the authority: it sees a worker exit the moment it
happens and publishes generation g with the original ranks still alive. A survivor whose
collective failed waits for a generation newer than its own, takes its place in the new
member list as its rank, and joins a process group whose store keys carry the generation.

Not every survivor's collective fails by itself: at 4 ranks one was seen blocked for good in
DDP's backward after a peer died. So a thread on each worker watches the generation and aborts
the worker's process groups (`ProcessGroup.abort`) as soon as a newer one is published; the
blocked call then raises and the worker regroups with the others.
"""

import os
import threading
import time

import torch.distributed as dist

GENERATION = "gradmesh/inplace/generation"


def _members_key(generation: int) -> str:
    return f"gradmesh/inplace/members/{generation}"


def publish_members(store, generation: int, members: list[int]) -> None:
    store.set(_members_key(generation), ",".join(map(str, members)))
    store.set(GENERATION, str(generation))


def enabled() -> bool:
    return os.environ.get("GRADMESH_INPLACE") == "1"


class Membership:
    """This worker's view: its original rank, the generation it is in, and who is in it."""

    def __init__(self, store, watch_store=None):
        self.store = store
        self.identity = int(os.environ.get("RANK", 0))
        self.generation = 0
        self.lock = threading.Lock()
        if watch_store is not None:
            threading.Thread(target=self._watch, args=(watch_store,), name="gradmesh-membership", daemon=True).start()

    def _watch(self, store, poll: float = 0.02) -> None:
        aborted = 0
        while True:
            try:
                newest = int(store.get(GENERATION))
            except Exception:  # the launcher and its store are gone: the job is over
                return
            with self.lock:  # never abort a group built for the newest generation
                if newest > self.generation and newest > aborted:
                    for group in list(dist.distributed_c10d._world.pg_names):
                        group.abort()
                    aborted = newest
            time.sleep(poll)

    def gather(self, members: list[int], timeout: float = 120.0) -> None:
        """Wait until every member of this generation is ready to form its group.

        A member may still be blocked in the broken group's collective for up to the collective
        timeout; forming the new group only once all are here keeps its own set-up from timing out."""
        from datetime import timedelta

        self.store.set(f"gradmesh/inplace/ready/{self.generation}/{self.identity}", "1")
        self.store.wait([f"gradmesh/inplace/ready/{self.generation}/{r}" for r in members], timedelta(seconds=timeout))

    def next(self, timeout: float = 60.0) -> list[int]:
        """Block until the launcher publishes a newer generation; its members (original ranks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            generation = int(self.store.get(GENERATION))
            if generation > self.generation:
                with self.lock:
                    self.generation = generation
                return [int(r) for r in self.store.get(_members_key(generation)).decode().split(",") if r]
            time.sleep(0.02)
        raise TimeoutError(f"no new membership from the launcher within {timeout:g} s")
