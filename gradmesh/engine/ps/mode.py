"""How a parameter-server job keeps its workers in step (`ps.mode`), parsed once and asked here.

Every rule that depends on the mode reads it from a `Mode`, so sync, async and ssp:K are told
apart in one place. ssp:0 is sync in everything that decides results (contract 10: the
single-process model): its shares are summed into one update per step, one share per worker,
no prediction. It differs from `sync` only in how the dispatcher hands out shares (on demand,
not each worker its own share of every step), which changes no result.

The learning rate a step is applied at comes from the one schedule every engine uses
(`gradmesh.engine.records.scheduled_lr`).
"""

from dataclasses import dataclass

from gradmesh.config.ps import parse_ps_mode


@dataclass(frozen=True)
class Mode:
    name: str
    """As configured: 'sync', 'async' or 'ssp:K'."""
    bound: int | None
    """The staleness bound: 0 (sync, ssp:0), K (ssp:K), None (async: none)."""

    @classmethod
    def parse(cls, text: str) -> "Mode":
        return cls(text, parse_ps_mode(text))

    @property
    def lockstep(self) -> bool:
        """A step's shares are summed and applied as one update, steps in order (sync, ssp:0);
        else each share is applied as it arrives, at its share of the learning rate."""
        return self.bound == 0

    @property
    def bounded(self) -> bool:
        """A pull waits for the server's frontier (sync, ssp); async answers at once."""
        return self.bound is not None

    @property
    def static_dispatch(self) -> bool:
        """Each worker computes its own share of every step, asked for ahead ('sync' alone;
        ssp:0 is dispatched on demand, as ssp is)."""
        return self.name == "sync"

    def shares_per_worker(self, configured: int, hybrid: bool) -> int:
        """`ps.shares` where shares are applied one by one (async, ssp:K >= 1), else one (lockstep
        and hybrid, whose workers all-reduce their dense part once per step)."""
        return configured if not self.lockstep and not hybrid else 1

    def predicts(self, configured: bool, hybrid: bool) -> bool:
        """Weight prediction (`gradmesh.engine.ps.predict`) applies: `ps.predict`, where workers
        pull parameters other shares have moved since (async, ssp:K >= 1; not hybrid)."""
        return configured and not self.lockstep and not hybrid

    def least_version(self, clock: int) -> int:
        """The version a pull for a share of step `clock` asks for (may be negative early on)."""
        return clock - self.bound if self.bound is not None else 0

    def may_answer(self, frontier: int, least: int) -> bool:
        """A pull asking for version `least` may be answered at this frontier."""
        return self.bound is None or frontier >= least

    def reported_version(self, version: int, frontier: int) -> int:
        """The version a server tells with its parameters: async, its update count; bounded,
        its frontier (every step before it wholly applied)."""
        return version if self.bound is None else frontier

    def staleness(self, clock: int, pulled: int, version: int) -> int:
        """Of a share of step `clock` computed on version `pulled`, applied at `version`: async,
        the updates applied since its pull; bounded, the steps its parameters lacked."""
        return version - pulled if self.bound is None else clock - pulled
