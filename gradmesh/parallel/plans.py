"""What a job runs: a `Plan`, the registry rows of its mesh's axes in composition order, and the
capabilities the rest of gradmesh asks of it instead of comparing strategy names
(`gradmesh.parallel.registry` resolves a strategy and mesh to one)."""

from dataclasses import dataclass

from gradmesh.config import compression as compressors
from gradmesh.parallel.strategy import ModelSize, Strategy, _all_bytes


def _carries(row: Strategy, compressor: compressors.Compressor) -> bool:
    """Whether `row`'s gradients can travel by `compressor`: its family takes it, and a row that
    reduces outside the job's reducer takes only a plain cast (or none: fp32 as it is)."""
    plain = compressor.reducer is None or compressor.wire_dtype is not None
    return row.engine in compressor.families and (plain or not row.casts_only)


@dataclass(frozen=True)
class Plan:
    """The strategies one job composes, on its named mesh."""

    label: str
    mesh: dict
    rows: tuple[Strategy, ...]
    """In composition order."""

    @property
    def engine(self) -> str:
        """The family that runs the plan: a row's own engine wins over the collective default."""
        return next((row.engine for row in self.rows if row.engine != "collective"), "collective")

    @property
    def runs_lockstep(self) -> bool:
        """Every rank steps together (parameter servers' workers go at their own pace): a rollback
        can rewind them all at once."""
        return self.engine not in ("ps", "actor-learner")

    @property
    def accepts_balance(self) -> bool:
        """--balance applies: its data-parallel ranks step together on equal work through the
        collective engine, whose per-rank shares the loop may move (the pipeline's and the
        servers' shares are their own)."""
        return self.engine == "collective"

    @property
    def has_servers(self) -> bool:
        """Some ranks serve parameters (`Strategy.has_servers`); its gradients travel as pushes
        through the servers' wire, not through the reducer with each parameter's place."""
        return any(row.has_servers for row in self.rows)

    @property
    def experience(self) -> bool:
        """It trains on its own actors' experience (`Strategy.experience`), not on a dataset."""
        return any(row.experience for row in self.rows)

    @property
    def pipelined(self) -> bool:
        """Its steps run as a pipeline of micro-batches (--microbatches and --pp-schedule apply)."""
        return any(row.engine == "pipeline" for row in self.rows)

    @property
    def equal_micro_batches(self) -> bool:
        """Every rank runs as many micro-batches a step (`Strategy.collective_forward`)."""
        return any(row.collective_forward or row.every_share for row in self.rows)

    @property
    def batch_norm(self) -> bool:
        """Models with batch normalisation train under it (`Strategy.batch_norm`)."""
        return all(row.batch_norm for row in self.rows)

    @property
    def reads_every_share(self) -> bool:
        """Some row is shown every rank's share of each micro-batch (`Strategy.every_share`)."""
        return any(row.every_share for row in self.rows)

    @property
    def shards_tables(self) -> bool:
        """Some row splits the sparse tables over its ranks (`Strategy.shards_tables`; --table-sharding applies)."""
        return any(row.shards_tables for row in self.rows)

    @property
    def step_breakdown(self) -> bool:
        return all(row.step_breakdown for row in self.rows)

    @property
    def alone(self) -> Strategy | None:
        return self.rows[0] if len(self.rows) == 1 else None

    @property
    def splits_model(self) -> bool:
        return any(row.splits_model for row in self.rows)

    @property
    def replicated(self) -> bool:
        return all(row.replicated for row in self.rows)

    @property
    def same_work(self) -> bool:
        return all(row.same_work for row in self.rows)

    @property
    def inplace_recovery(self) -> bool:
        return all(row.inplace_recovery for row in self.rows)

    @property
    def compressions(self) -> tuple[str, ...]:
        """The --compression methods (none first) every row's gradients can travel by, in the
        compressor registry's order."""
        return tuple(c.name for c in compressors.ROWS if all(_carries(row, c) for row in self.rows))

    @property
    def state_owner(self) -> Strategy:
        """The row whose optimizer and optimizer-state functions the job uses (the data axis's)."""
        return self.rows[-1]

    def state_bytes(self, size: ModelSize) -> float:
        """Bytes of model state one rank holds: each row keeps its formula's share of what the rows
        before it left (a tensor-parallel split, then a pipeline stage, then the data axis's)."""
        whole = _all_bytes(size)
        share = 1.0
        for row in self.rows:
            share *= row.state_bytes(size, self.mesh[row.axis]) / whole if whole else 1.0
        return whole * share

    def check(self, cfg, meta_model) -> None:
        """Every row's pre-launch checks."""
        for row in self.rows:
            for check in row.checks:
                check(cfg, self.mesh, meta_model)
