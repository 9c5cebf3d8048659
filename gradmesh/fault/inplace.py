"""In-place recovery's membership protocol over the job's c10d store.

The launcher (`gradmesh.launch.inplace`) is the authority: it sees a worker exit the moment it
happens and publishes generation g with the members (original ranks, "identities") still
alive; when a replacement worker it started is ready, it publishes a generation that adds it.
A worker joins a process group whose store keys carry the generation.

Losses and additions are handled differently:

- A generation that *loses* a member interrupts the step. A survivor's collective does not
  always fail by itself (at 4 ranks, gloo blocked in a ring whose partner had left the broken
  group, until the collective timeout), so the collectives of a step are started through
  `guard`, which returns a future that a watcher thread fails the moment such a generation is
  published. The survivors then redo the step together in the new group.
- A generation that only *adds* members is entered between steps. The members agree, through
  a compare-and-set in the store, on the step at which they switch: two steps after the first
  member to notice (ranks are never more than one step apart: each step ends in an all-reduce).
  The first member of the new group then hands its state to the newcomers (`gradmesh.fault.handover`).

What no library offers here is a policy: torch elastic restarts every worker on a failure and
torchft drops the failed group's samples, so this small protocol is gradmesh's own.
"""

import re
import threading
import time

import torch

from gradmesh import env

GENERATION = "gradmesh/inplace/generation"
COUNTER = "gradmesh/inplace/counter"
FINISHED = "gradmesh/inplace/finished"


def _members_key(generation: int) -> str:
    return f"gradmesh/inplace/members/{generation}"


def joining_key(identity: int) -> str:
    """Set by a replacement worker once it is built and ready to be admitted."""
    return f"gradmesh/inplace/joining/{identity}"


def _admitted_key(identity: int) -> str:
    return f"gradmesh/inplace/admitted/{identity}"


def publish_members(store, members: list[int]) -> int:
    """A new generation with these members; its number (allocated atomically in the store)."""
    generation = store.add(COUNTER, 1) - 1
    store.set(_members_key(generation), ",".join(map(str, members)))
    store.set(GENERATION, str(generation))
    return generation


EVICTIONS = "gradmesh/inplace/evictions"


def _evict_key(identity: int) -> str:
    return f"gradmesh/inplace/evict/{identity}"


def request_eviction(store, identity: int) -> None:
    """Ask the launcher to stop a worker that hangs (it then counts as lost)."""
    store.set(_evict_key(identity), "1")
    store.add(EVICTIONS, 1)


def evictions_requested(store, seen: int, identities) -> tuple[int, list[int]]:
    """(requests so far, the identities among `identities` asked to be evicted) once the count
    has grown past `seen`; one store round trip when nothing new was asked."""
    count = store.add(EVICTIONS, 0)
    if count <= seen:
        return seen, []
    return count, [i for i in identities if store.check([_evict_key(i)])]


BOUND = 2**31
"""Identities and generation numbers in the store stay below this (steps below 2^63)."""


class BadStoreValue(RuntimeError):
    """The store held something no gradmesh process writes: refused, never acted on."""


def whole(raw: bytes | str, what: str, bound: int = BOUND) -> int:
    """A whole number read from the job's store, checked before it picks ranks or steps."""
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
    if not (re.fullmatch(r"[0-9]{1,19}", text) and int(text) < bound):
        raise BadStoreValue(
            f"in-place recovery's store holds {text[:40]!r} as {what}; expected a whole number below {bound}"
        )
    return int(text)


def members_of(store, generation: int) -> list[int]:
    raw = store.get(_members_key(generation)).decode("ascii", "replace")
    members = [whole(r, f"a member of generation {generation}") for r in raw.split(",") if r]
    if len(set(members)) != len(members):
        raise BadStoreValue(f"in-place recovery's store lists a member twice in generation {generation}: {raw[:80]!r}")
    return members


enabled = env.inplace_enabled
joining = env.inplace_joining


class MembersLost(RuntimeError):
    """A member left: the step's collectives will not complete (a RuntimeError, like gloo's own)."""


class Regroup(RuntimeError):
    """A newer generation appeared while forming a group: form that one instead."""


class RunFinished(Exception):
    """A replacement worker arrived after the run had ended."""


class Membership:
    """This worker's view: its identity, the generation it is in, and who is in it."""

    def __init__(self, store, watch_store=None) -> None:
        self.store = store
        self.identity = env.placement().rank
        self.generation, self.members = 0, members_of(store, 0) if not joining() else []
        self.newcomers: list[int] = []
        """Members of the current generation that were not in the one before (they need the state)."""
        self.lock = threading.Lock()
        self.pending: set[torch.futures.Future] = set()
        self.lost_at = -1
        self.departed: set[int] = set()
        """Identities seen to leave (cumulative): a parameter server hands their work to others."""
        if watch_store is not None:
            threading.Thread(target=self._watch, args=(watch_store,), name="gradmesh-membership", daemon=True).start()

    # -- losses: fail the step's collectives at once -----------------------------------------

    def _watch(self, store, poll: float = 0.02) -> None:
        while True:
            try:
                newest = whole(store.get(GENERATION), "the newest generation")
                with self.lock:  # one consistent view: the main thread may be entering a generation
                    generation, current = self.generation, set(self.members)
                if newest > generation and newest > self.lost_at:
                    departed = current - set(members_of(store, newest))
                    if departed:
                        self._fail_pending(newest, seen_in=generation, departed=departed)
            except Exception:  # the launcher and its store are gone: the job is over
                return
            time.sleep(poll)

    def _fail_pending(self, generation: int, seen_in: int, departed: set[int]) -> None:
        with self.lock:
            if self.generation != seen_in:
                return  # regrouped past that loss meanwhile: failing the new group's step would be spurious
            self.lost_at = generation
            self.departed |= departed
            pending, self.pending = self.pending, set()
        for future in pending:
            if not future.done():
                future.set_exception(MembersLost(f"in-place recovery: a member left (generation {generation})"))

    def guard(self, future: torch.futures.Future) -> torch.futures.Future:
        """A future for an async collective's result that also fails when a member is lost."""
        guarded: torch.futures.Future = torch.futures.Future()

        def settle(done):
            with self.lock:
                self.pending.discard(guarded)
                if guarded.done():
                    return
                try:
                    guarded.set_result(done.value())
                except Exception as err:
                    guarded.set_exception(err)
            return None

        with self.lock:
            if self.lost_at > self.generation:
                guarded.set_exception(MembersLost("in-place recovery: a member left"))
                return guarded
            self.pending.add(guarded)
        future.then(settle)
        return guarded

    def loss_seen(self) -> bool:
        """A member of this generation has left (the launcher published a smaller generation)."""
        with self.lock:
            return self.lost_at > self.generation

    def wait(self, work) -> None:
        """`work.wait()` that raises MembersLost instead of blocking on a lost member."""
        self.guard(work.get_future()).wait()

    # -- forming the next group ---------------------------------------------------------------

    def newest(self) -> int:
        return whole(self.store.get(GENERATION), "the newest generation")

    def next(self, timeout: float = 60.0) -> list[int]:
        """Block until a generation newer than this worker's appears; enter it, return its members."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            generation = self.newest()
            if generation > self.generation:
                return self.enter(generation)
            time.sleep(0.02)
        raise TimeoutError(f"no new membership from the launcher within {timeout:g} s")

    def enter(self, generation: int) -> list[int]:
        members = members_of(self.store, generation)
        with self.lock:
            self.newcomers = [m for m in members if m not in self.members]
            self.generation, self.members = generation, members
        if members and members[0] == self.identity:
            for newcomer in self.newcomers:  # tell each newcomer which group to form
                self.store.set(_admitted_key(newcomer), str(generation))
        return members

    def gather(self, timeout: float = 120.0) -> None:
        """Wait until every member of this generation is ready to form its group.

        A member may still be finishing the broken group's step; forming the new group only once
        all are here keeps its own set-up from timing out. A newer generation (another loss, or a
        replacement admitted meanwhile) raises Regroup."""
        prefix = f"gradmesh/inplace/ready/{self.generation}/"
        self.store.set(prefix + str(self.identity), "1")
        keys = [prefix + str(m) for m in self.members]
        deadline = time.monotonic() + timeout
        while not self.store.check(keys):
            newest = self.newest()
            if newest > self.generation and (self.identity not in self.members or not self._is_join(newest)):
                raise Regroup("a newer membership generation appeared while regrouping")
            if time.monotonic() > deadline:
                missing = [m for m in self.members if not self.store.check([prefix + str(m)])]
                raise TimeoutError(f"in-place recovery: members {missing} did not arrive within {timeout:g} s")
            time.sleep(0.005)

    def _is_join(self, generation: int) -> bool:
        return set(self.members) <= set(members_of(self.store, generation))

    # -- additions: switch between steps ------------------------------------------------------

    def admits_now(self, step: int, last_step: int) -> bool:
        """At the start of `step`: is this the step at which the members switch to a newer
        generation that only adds members? (One store round trip per step.)"""
        newest = self.newest()
        if newest <= self.generation or not self._is_join(newest):
            return False  # a loss is handled by the failed collective, not here
        agreed = whole(
            self.store.compare_set(f"gradmesh/inplace/switch/{newest}", "", str(step + 2)),
            "the step to admit at",
            bound=2**63,
        )
        if agreed > last_step:
            return False  # the run ends first: the newcomer is told so when it does
        return agreed == step

    def evict(self, identity: int) -> None:
        """Ask the launcher to stop a member that hangs (a parameter server's --step-timeout)."""
        request_eviction(self.store, identity)

    def finish(self) -> None:
        """The run is over: a replacement still waiting to join may leave."""
        self.store.set(FINISHED, "1")

    def wait_for_admission(self, poll: float = 0.02) -> list[int]:
        """A replacement: announce readiness, wait for the members to admit this worker."""
        self.store.set(joining_key(self.identity), "1")
        while True:
            if self.store.check([_admitted_key(self.identity)]):
                generation = whole(self.store.get(_admitted_key(self.identity)), "the admitting generation")
                if generation > self.generation:
                    return self.enter(generation)
            if self.store.check([FINISHED]):
                raise RunFinished
            time.sleep(poll)
