"""The fault section of the configuration: recovery, hang detection, non-finite steps, injection."""

from dataclasses import dataclass

from gradmesh.chaos import parse_inject
from gradmesh.config.checks import finite, one_of, positive
from gradmesh.errors import UsageError

RECOVERY = ("none", "restart", "inplace")
NONFINITE = ("stop", "skip", "rollback")
AUTO_STEP_TIMEOUT = -1.0
"""fault.step_timeout's value for `--step-timeout auto`."""
AUTO_TIMEOUT_FLOOR, AUTO_TIMEOUT_FACTOR, AUTO_TIMEOUT_CAP = 300.0, 20.0, 1500.0
"""auto: a step is a hang past max(300 s, 20 x the slowest step so far), at most 25 minutes, so
that torch's own collective timeout (30 minutes) never fires first; the first step after a
(re)start, which builds caches and lazily initialised state, is allowed the cap."""


def auto_timeout(slowest: float) -> float:
    """auto's limit once the slowest piece of work so far took `slowest` seconds (0: none done yet)."""
    if slowest <= 0:
        return AUTO_TIMEOUT_CAP
    return min(AUTO_TIMEOUT_CAP, max(AUTO_TIMEOUT_FLOOR, AUTO_TIMEOUT_FACTOR * slowest))


@dataclass(kw_only=True)
class FaultConfig:
    """Surviving failures: detection, recovery, and injected faults for testing them."""

    recovery: str = "none"
    """none (a failure ends the run), restart (every worker restarts from the latest checkpoint) or
    inplace (the survivors rebuild their group and go on from the current step; ddp and ps, one machine;
    under ps a lost server restarts every rank)."""
    max_restarts: int = 3
    """recovery=restart: restarts of the worker group allowed before the run fails.
    recovery=inplace: replacement workers started for lost ones (they join the running job).
    on_nonfinite=rollback: rollbacks allowed before the run stops."""
    step_timeout: float = AUTO_STEP_TIMEOUT
    """Seconds a step may take before the run is declared hung (stacks dumped, ranks named); 0: off;
    -1 (--step-timeout auto, the default): max(300 s, 20 x the slowest step so far), at most 25 minutes."""
    on_nonfinite: str = "stop"
    """A NaN or infinite loss, gradient or parameter-server push: stop (apply nothing and end the run,
    exit code 4), skip (drop that step's update on every rank) or rollback (back to the last intact
    checkpoint, that step's global batch skipped)."""
    max_skips: int = 5
    """on_nonfinite=skip: consecutive skipped steps after which the run stops as under stop."""
    inject: str = ""
    """Faults to inject, ';'-separated: kill:rank=R,step=N[,at=checkpoint]  hang:rank=R,step=N
    slow:rank=R,factor=F|delay=S  diverge:rank=R,step=N  memory:rank=R,free_mb=M  nan:rank=R,step=N[,steps=M]
    chaos:faults=N,seed=S[,kinds=kill+hang+slow][,pace=S]."""

    def __post_init__(self):
        finite(self)
        one_of("fault", "recovery", self.recovery, RECOVERY)
        one_of("fault", "on_nonfinite", self.on_nonfinite, NONFINITE)
        positive("fault", "max_restarts", self.max_restarts, allow_zero=True)
        positive("fault", "max_skips", self.max_skips)
        if self.step_timeout != AUTO_STEP_TIMEOUT:
            positive("fault", "step_timeout", self.step_timeout, allow_zero=True)
        if self.on_nonfinite == "rollback" and self.recovery == "inplace":
            raise UsageError(
                "--on-nonfinite rollback goes back to a checkpoint with the same group of ranks; "
                "with --recovery inplace use --on-nonfinite stop or skip"
            )
        parse_inject(self.inject)

    @property
    def auto_timeout(self) -> bool:
        return self.step_timeout == AUTO_STEP_TIMEOUT

    @property
    def explicit_timeout(self) -> float:
        """--step-timeout SECONDS as given; 0 when off or auto."""
        return max(self.step_timeout, 0.0)
