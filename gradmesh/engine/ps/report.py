"""What a segment leaves for its report: a rank's figures of the work (`Done`), a server's view
of workers dying (`Lookout`), and each step's share of the segment's time."""

from dataclasses import dataclass

import torch

from gradmesh.engine.ps.segment import Segment


@dataclass
class Done:
    """What a rank did in a segment's point-to-point part, kept for its report (which a regroup
    may repeat: a role clock and a byte counter are taken once)."""

    segment: Segment
    log: torch.Tensor | None
    """The dispatcher's log (`ParameterServerEngine._log_rows`); None elsewhere."""
    stats: dict | None
    """A server's staleness figures per step (`Server.stats`)."""
    clock: torch.Tensor
    sent: int


class Lookout:
    """A server's view of workers dying under in-place recovery: `lookout()` is true while a
    death is unseen, `take()` gives the ranks (in the segment's group) of those newly seen."""

    def __init__(self, membership, identities: list[int]):
        self.membership, self.identities, self.seen = membership, identities, set()

    def _new(self) -> set[int]:
        return (self.membership.departed & set(self.identities)) - self.seen

    def __call__(self) -> bool:
        return bool(self._new())

    def take(self) -> list[int]:
        new = self._new()
        self.seen |= new
        return sorted(self.identities.index(identity) for identity in new)


def step_seconds(started: float, applied: list[float]) -> list[float]:
    """Each step's share of the segment's time, from when each was applied (in order of steps).

    A step applied before an earlier one (async and ssp let later steps finish first) took no
    time of its own: it shares the time of the step that finished last before it (or, at the
    start, the next one's), so no step reports zero seconds and the sum is the segment's time."""
    groups: list[list] = []  # [seconds, steps]
    latest = started
    for moment in applied:
        gained = moment - latest
        if gained > 0 or not groups:
            groups.append([max(gained, 0.0), 1])
        else:
            groups[-1][1] += 1
        latest = max(latest, moment)
    if len(groups) > 1 and groups[0][0] == 0:  # steps done at the very start share the next one's time
        seconds, steps = groups.pop(0)
        groups[0][1] += steps
    return [max(seconds / steps, 1e-9) for seconds, steps in groups for _ in range(steps)]
