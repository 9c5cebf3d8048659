"""The parameter-server section of the configuration (`--strategy ps`)."""

from dataclasses import dataclass

from gradmesh.config.checks import finite, positive, whole
from gradmesh.errors import UsageError

PS_MODES = ("sync", "async", "ssp:K")
MAX_SHARES = 64
"""ps.shares at most: each share is a pull and a push of the dense parameters (and a share of
less than one sample is no work at all, so `check_ps` also bounds it by the samples per worker)."""


def parse_ps_mode(text: str) -> int | None:
    """'sync' -> 0 (ssp:0 is sync), 'ssp:K' -> K, 'async' -> None (no bound)."""
    if text == "sync":
        return 0
    if text == "async":
        return None
    kind, sep, bound = text.partition(":")
    if kind != "ssp" or not sep or not whole(bound):
        raise UsageError(f"ps.mode {text!r} is not one of sync, async, ssp:K (K a whole number >= 0, e.g. ssp:2)")
    return int(bound)


@dataclass(kw_only=True)
class PSConfig:
    """Parameter servers: how many ranks hold the parameters, and how workers synchronise with them."""

    servers: int = 1
    """Ranks that hold the parameters and optimizer state, sharded by bytes; the other ranks are workers."""
    mode: str = "sync"
    """sync (one update per step from every worker: single-process training), async (each worker's
    gradient applied as it arrives) or ssp:K (no worker more than K steps ahead of the slowest)."""
    shares: int = 2
    """async and ssp:K >= 1: the shares each worker's part of a global batch is cut into, each its
    own update: smaller, more frequent updates with less staleness (sync keeps data parallelism's
    one share per worker, and so do hybrid's workers, which all-reduce their dense part). At most
    64, and at most the samples each worker gets per step (global_batch_size / workers)."""
    predict: bool = True
    """async and ssp:K >= 1: workers compute on the parameters predicted for when their gradient
    lands (moved along their recent velocity by the updates expected meanwhile); false: as pulled."""

    def __post_init__(self):
        finite(self)
        positive("ps", "servers", self.servers)
        positive("ps", "shares", self.shares)
        if self.shares > MAX_SHARES:
            raise UsageError(
                f"ps.shares must be 1..{MAX_SHARES} (each share is a pull and a push of the parameters), "
                f"got {self.shares}"
            )
        parse_ps_mode(self.mode)

    @property
    def bound(self) -> int | None:
        """The staleness bound: 0 for sync, K for ssp:K, None for async."""
        return parse_ps_mode(self.mode)


def check_ps_options_need_ps(cfg, strategy: str, with_servers: list[str]) -> None:
    """--ps-servers and --ps-mode mean nothing to another strategy: refused rather than ignored
    (except on --resume, where they come from the saved config of a run that used ps)."""
    given, default = cfg.ps, PSConfig()
    if (
        strategy not in with_servers
        and not cfg.checkpoint.resume
        and (given.servers, given.mode, given.shares) != (default.servers, default.mode, default.shares)
    ):
        raise UsageError(
            f"--ps-servers, --ps-mode and --ps-shares apply to --strategy {' or '.join(with_servers)}, not "
            f"{strategy}; leave them out or give --strategy {with_servers[0]}"
        )
