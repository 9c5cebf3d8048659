"""The driver's side of `gradmesh ray`: a placement group of one bundle per worker, one actor per
bundle (rank = bundle index), rank 0's node address and a free port there as the job's store, and
the group watched as a whole: any failure ends the whole group, and a lost worker (its actor died,
its process was killed, or it hung) starts a new group that resumes from the latest checkpoint.

Rank 0 hosting the store is what sank torchft's Ray prototype: the store died with it and the
survivors waited on it. Here nothing outlives a failure: the driver kills every actor of the group
(their workers die with them, `gradmesh.lifeline`) and removes the placement group, and the next
group gets fresh actors, wherever Ray places them, and a fresh store at a fresh port.
"""

import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from gradmesh import lifeline
from gradmesh.errors import EXIT_HANG, EXIT_NONFINITE, UsageError
from gradmesh.ray.actor import WorkerActor

PLACEMENT_S = 120.0
"""How long a group waits for Ray to place its bundles (a cluster may be scaling up)."""
WAKE_S = 0.5
"""The longest the driver waits on Ray at a time, so that a signal to it is acted on in this time."""
PEER_GRACE_S = 10.0
"""After one rank fails, how long the others have to end by themselves: whether a peer was lost
first (its survivors then fail on the broken connection) decides between a restart and an error."""


class Unplaced(Exception):
    """Ray could not place the group's bundles in time."""


@dataclass(frozen=True)
class Shape:
    """The Ray resources of the job: `workers` bundles of `cpus` CPUs (and one GPU each with `gpu`)."""

    workers: int
    cpus: int = 1
    gpu: bool = False

    def bundle(self) -> dict[str, float]:
        return {"CPU": float(self.cpus), **({"GPU": 1.0} if self.gpu else {})}


@dataclass(frozen=True)
class Outcome:
    """How one rank's worker ended: its exit code, or None where its actor died under it."""

    rank: int
    code: int | None
    node: str = ""
    tail: str = ""
    died: str = ""

    @property
    def ok(self) -> bool:
        return self.code == 0

    @property
    def lost(self) -> bool:
        """Gone for a reason outside the worker's own code: restarting can help."""
        return self.code is None or self.code < 0 or self.code == EXIT_HANG

    def describe(self) -> str:
        who = f"worker rank {self.rank}" + (f" (node {self.node})" if self.node else "")
        if self.code is None:
            return f"{who}: its Ray actor died ({self.died})"
        if self.code < 0:
            return f"{who} was killed by {signal.Signals(-self.code).name}"
        if self.code == EXIT_HANG:
            return f"{who} hung (its step watchdog fired; see the hang report above)"
        return f"{who} exited with code {self.code}"


def check_room(ray: Any, shape: Shape) -> None:
    """UsageError when the cluster as a whole lacks the resources of the job's bundles."""
    have = ray.cluster_resources()
    need = {name: amount * shape.workers for name, amount in shape.bundle().items()}
    if all(have.get(name, 0) >= amount for name, amount in need.items()):
        return
    listed = ", ".join(f"{amount:g} {name}" for name, amount in need.items())
    has = ", ".join(f"{have.get(name, 0):g} {name}" for name in need)
    raise UsageError(
        f"--num-workers {shape.workers}: the workers need {listed} but the Ray cluster has {has}; "
        "use fewer workers (or --cpus-per-worker), or add nodes"
    )


def _outcome(ray: Any, ref: Any, rank: int) -> Outcome:
    try:
        done = ray.get(ref)
    except ray.exceptions.RayActorError as err:
        return Outcome(rank, None, died=(str(err).strip().splitlines() or [type(err).__name__])[0])
    except ray.exceptions.RayTaskError as err:  # the actor's own code failed (it could not start the worker)
        return Outcome(rank, 1, tail=str(err))
    return Outcome(rank, done["code"], node=done["node"], tail=done["tail"])


def _watch(ray: Any, refs: dict) -> list[Outcome]:
    """Every rank's outcome, in the order they ended, up to the first failure and the peers that
    ended within PEER_GRACE_S of it."""
    outcomes: list[Outcome] = []
    pending = list(refs)
    with lifeline.deferred_stop() as stop:  # `gradmesh ray` stopped: acted on within WAKE_S
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=WAKE_S)
            stop.check()
            if not done:
                continue
            outcomes.append(_outcome(ray, done[0], refs[done[0]]))
            if not outcomes[-1].ok:
                if pending:
                    late, _ = ray.wait(pending, num_returns=len(pending), timeout=PEER_GRACE_S)
                    outcomes += [_outcome(ray, ref, refs[ref]) for ref in late]
                break
    return outcomes


def _placed(group: Any) -> bool:
    """Whether Ray placed the group's bundles within PLACEMENT_S (a busy cluster: when other jobs
    free them), waiting in WAKE_S turns, so that a signal meanwhile is acted on."""
    deadline = time.monotonic() + PLACEMENT_S
    with lifeline.deferred_stop() as stop:
        while not group.wait(WAKE_S):
            stop.check()
            if time.monotonic() >= deadline:
                return False
    return True


def _run_group(ray: Any, config_path: str, shape: Shape, settings: dict) -> list[Outcome]:
    """One group of actors, from placement to the end of its workers; its actors and bundles are
    gone when this returns, whatever happened."""
    from ray.util import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([shape.bundle()] * shape.workers, strategy="SPREAD")
    actors = []
    try:
        if not _placed(group):
            raise Unplaced(f"Ray placed no group of {shape.workers} x {shape.bundle()} within {PLACEMENT_S:g} s")
        worker = ray.remote(WorkerActor)
        for rank in range(shape.workers):
            where = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
            actors.append(
                worker.options(
                    num_cpus=shape.cpus, num_gpus=int(shape.gpu), max_restarts=0, scheduling_strategy=where
                ).remote()
            )
        try:
            master = ray.get(actors[0].endpoint.remote())
        except ray.exceptions.RayActorError as err:
            return [Outcome(0, None, died=str(err).strip().splitlines()[0])]
        refs = {actor.run.remote(config_path, rank, shape.workers, master, settings): rank
                for rank, actor in enumerate(actors)}  # fmt: skip
        return _watch(ray, refs)
    finally:
        for actor in actors:
            ray.kill(actor)  # the workers die with their actors
        remove_placement_group(group)


def _last_word(tail: str) -> str:
    """A worker's last line of its own (`gradmesh: ...`): shown by the driver too, as Ray forwards
    the workers' output to it in the background and may not have passed that line on yet."""
    return next((line for line in reversed(tail.splitlines()) if "gradmesh:" in line), "")


def run_job(ray: Any, config_path: str, shape: Shape, max_failures: int, settings: dict) -> tuple[int, str]:
    """(exit code, what to say) of the job: groups started until one finishes, a worker's own
    error ends it, or `max_failures` restarts after lost workers are spent."""
    for attempt in range(max_failures + 1):
        try:
            outcomes = _run_group(ray, config_path, shape, {**settings, "attempt": attempt})
        except Unplaced as err:
            return 1, f"gradmesh: {err}; the cluster lacks the room (see `ray status`)"
        failed = [outcome for outcome in outcomes if not outcome.ok]
        if not failed:
            return 0, ""
        stopped = sorted((outcome for outcome in failed if outcome.code == EXIT_NONFINITE), key=lambda o: o.rank)
        if stopped:  # every rank stops together; rank 0 has said which step, rank and values, in one line
            return EXIT_NONFINITE, _last_word(stopped[0].tail)
        cause = next((outcome for outcome in failed if outcome.lost), None)
        if cause is None:
            first = failed[0]
            tail = "".join(f"  {line}\n" for line in first.tail.rstrip("\n").splitlines())
            return 1, f"gradmesh: {first.describe()}; the end of its output:\n{tail}".rstrip("\n")
        if attempt == max_failures:
            return 1, f"gradmesh: {cause.describe()}; no restart left (--max-failures {max_failures})"
        print(
            f"gradmesh: {cause.describe()}; restarting all {shape.workers} workers from the latest checkpoint "
            f"(restart {attempt + 1} of {max_failures})",
            file=sys.stderr,
            flush=True,
        )
    raise AssertionError("unreachable: the last attempt returns")
