"""The small option languages of the command line, parsed where the config is checked.

`--inject` takes fault specifications (kill, hang, slow, diverge, memory, nan). Their grammar lives here,
at the config layer, so that checking a config needs no fault-handling code; the injector
(`gradmesh.fault.inject`) acts on the parsed `Fault` records.
"""

import math
from dataclasses import dataclass

from gradmesh.errors import UsageError

KINDS = {
    "kill": {"rank", "step", "at"},
    "hang": {"rank", "step"},
    "slow": {"rank", "factor", "delay", "step", "steps"},
    "diverge": {"rank", "step"},
    "memory": {"rank", "free_mb"},
    "nan": {"rank", "step", "steps"},
}
FORMS = (
    "kill:rank=R,step=N[,at=checkpoint], hang:rank=R,step=N, slow:rank=R,factor=F|delay=SECONDS[,step=N,steps=M], "
    "diverge:rank=R,step=N, memory:rank=R,free_mb=M, nan:rank=R,step=N[,steps=M] or "
    "chaos:faults=N,seed=S[,kinds=kill+hang+slow][,pace=SECONDS]"
)


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int = 0
    at: str = "step"
    """kill only: 'step' (before the step runs) or 'checkpoint' (mid-write of that step's checkpoint)."""
    factor: float = 1.0
    delay: float = 0.0
    """slow only: seconds added to every step (factor multiplies the step's own time)."""
    steps: int = 0
    """slow: for this many steps from `step` (0: the whole run); nan: this many steps (0: one)."""
    free_mb: float = 0.0
    """memory only: the memory the rank is told it has free for its share's activations (MiB)."""
    chaos: int = -1
    """A chaos fault's number (>= 0): it hits whichever rank is `rank` modulo the world size when
    its step comes (under in-place recovery ranks change hands), not the worker started as `rank`."""

    @property
    def label(self) -> str:
        if self.chaos >= 0:
            window = f",steps={self.steps}" if self.kind == "slow" else ""
            return f"chaos#{self.chaos}:{self.kind}@step={self.step}{window}" + (
                ",at=checkpoint" if self.at == "checkpoint" else ""
            )
        if self.kind == "memory":
            return f"memory:rank={self.rank},free_mb={self.free_mb:g}"
        if self.kind == "nan" and self.steps:
            return f"nan:rank={self.rank},step={self.step},steps={self.steps}"
        if self.kind == "slow":
            window = f",step={self.step},steps={self.steps}" if self.steps else ""
            return (
                f"slow:rank={self.rank},factor={self.factor:g}"
                + (f",delay={self.delay:g}" if self.delay else "")
                + window
            )
        at = ",at=checkpoint" if self.at == "checkpoint" else ""
        return f"{self.kind}:rank={self.rank},step={self.step}{at}"


def _is_chaos(text: str) -> bool:
    return text.strip().startswith("chaos:")


def _parse_one(text: str) -> Fault:
    kind, _, rest = text.strip().partition(":")
    fields = dict(part.partition("=")[::2] for part in rest.split(",") if part)
    if kind not in KINDS or not rest or set(fields) - KINDS[kind] or "rank" not in fields or not rest.isascii():
        raise UsageError(f"--inject {text!r}: expected {FORMS}")
    try:
        fault = Fault(
            kind,
            int(fields["rank"]),
            step=int(fields.get("step", 0)),
            at=fields.get("at", "step"),
            factor=float(fields.get("factor", 1.0)),
            delay=float(fields.get("delay", 0.0)),
            steps=int(fields.get("steps", 0)),
            free_mb=float(fields.get("free_mb", 0.0)),
        )
    except ValueError:
        raise UsageError(
            f"--inject {text!r}: rank and step must be whole numbers, factor a number; expected {FORMS}"
        ) from None
    if kind == "memory" and not (0 < fault.free_mb < math.inf):
        raise UsageError(f"--inject {text!r}: memory needs free_mb > 0 (MiB), e.g. memory:rank=1,free_mb=64")
    if (
        (kind not in ("slow", "memory") and fault.step < 1)
        or fault.rank < 0
        or fault.step < 0
        or fault.steps < 0
        or fault.at not in ("step", "checkpoint")
        or not math.isfinite(fault.factor)
        or not math.isfinite(fault.delay)
        or fault.factor < 1
        or fault.delay < 0
    ):
        raise UsageError(
            f"--inject {text!r}: needs rank >= 0, step >= 1, a finite factor >= 1 and delay >= 0, at=step|checkpoint"
        )
    return fault


def parse_faults(text: str) -> list[Fault]:
    """The explicit faults (a chaos spec is read by `parse_chaos`)."""
    return [_parse_one(part) for part in text.split(";") if part.strip() and not _is_chaos(part)]


def check_ranks(faults: list[Fault], world_size: int) -> None:
    for fault in faults:
        if fault.rank >= world_size:
            raise UsageError(f"--inject {fault.label}: rank {fault.rank} does not exist (ranks 0..{world_size - 1})")


def check_memory_faults(faults: list[Fault], balance: str) -> None:
    """memory faults act on --balance's memory guard, which only runs with balancing on."""
    for fault in faults:
        if fault.kind == "memory" and balance == "off":
            raise UsageError(
                f"--inject {fault.label} acts on the memory guard of --balance: use it with "
                "--balance auto or static:S1,S2,..."
            )
