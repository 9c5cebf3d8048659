"""Chaos: many random faults in one run, to soak-test recovery (issue 13, item 9).

`--inject chaos:faults=N,seed=S[,kinds=kill+hang+slow][,pace=SECONDS]` plans N faults at N
distinct steps from a seeded generator, so a soak is reproducible: kills (at a step where a
checkpoint is written, in the middle of writing it), hangs (caught by `--step-timeout`) and
slow-downs of one to three steps. Each is aimed at whichever rank holds a position when its
step comes — rank 0 included — because under in-place recovery the workers behind the ranks
change. `pace` adds that many seconds to every step of every rank: a stand-in for a larger
model's compute, so that replacement workers, which take seconds to start, join mid-run as in
a long job. Torch-free: the CLI checks a spec before launch.
"""

import math
import random
from dataclasses import dataclass

from gradmesh.errors import UsageError
from gradmesh.specs import Fault, parse_faults

KINDS = ("kill", "hang", "slow")
FORM = "chaos:faults=N,seed=S[,kinds=kill+hang+slow][,pace=SECONDS]"


@dataclass(frozen=True)
class Chaos:
    faults: int
    seed: int
    kinds: tuple[str, ...] = KINDS
    pace: float = 0.0


def _fields(text: str) -> dict[str, str]:
    fields = dict(part.partition("=")[::2] for part in text.strip()[len("chaos:") :].split(",") if part)
    if not text.isascii() or set(fields) - {"faults", "seed", "kinds", "pace"} or not {"faults", "seed"} <= set(fields):
        raise UsageError(f"--inject {text.strip()!r}: expected {FORM}")
    return fields


def parse_chaos(text: str) -> Chaos | None:
    """The chaos spec among `--inject`'s ';'-separated faults; None without one."""
    specs = [part for part in text.split(";") if part.strip().startswith("chaos:")]
    if not specs:
        return None
    if len(specs) > 1:
        raise UsageError("--inject: give at most one chaos:... spec (its faults= sets how many faults)")
    fields = _fields(specs[0])
    kinds = tuple(fields.get("kinds", "+".join(KINDS)).split("+"))
    try:
        chaos = Chaos(int(fields["faults"]), int(fields["seed"]), kinds, float(fields.get("pace", 0)))
    except ValueError:
        raise UsageError(
            f"--inject {specs[0].strip()!r}: faults and seed must be whole numbers, pace a number; expected {FORM}"
        ) from None
    if (
        chaos.faults < 1
        or not 0 <= chaos.seed < 2**63
        or not set(kinds) <= set(KINDS)
        or len(set(kinds)) != len(kinds)
        or not math.isfinite(chaos.pace)
        or chaos.pace < 0
    ):
        raise UsageError(
            f"--inject {specs[0].strip()!r}: needs faults >= 1, seed in [0, 2^63), kinds from "
            f"{'+'.join(KINDS)} and a finite pace >= 0"
        )
    return chaos


def parse_inject(text: str) -> tuple[list[Fault], Chaos | None]:
    """All of `--inject`: the explicit faults and the chaos spec (UsageError on a bad one)."""
    return parse_faults(text), parse_chaos(text)


def check_chaos(chaos: Chaos | None, max_steps: int, recovery: str, step_timeout: float) -> None:
    """Before launch: room for the faults, and a recovery that can survive them."""
    if chaos is None:
        return
    if chaos.faults > max_steps - 2:
        raise UsageError(
            f"--inject chaos: {chaos.faults} faults need at least {chaos.faults + 2} steps "
            f"(one per step, from step 2 to the next-to-last); --max-steps is {max_steps}"
        )
    if recovery == "none" and set(chaos.kinds) != {"slow"}:
        raise UsageError("--inject chaos with kills or hangs needs --recovery restart or inplace")
    if "hang" in chaos.kinds and not step_timeout:
        raise UsageError("--inject chaos with hangs needs --step-timeout SECONDS to detect them (or kinds=kill+slow)")


def plan(chaos: Chaos, max_steps: int, checkpoint_every: int) -> list[Fault]:
    """The N faults, the same on every worker and every restart."""
    rng = random.Random(chaos.seed)
    steps = sorted(rng.sample(range(2, max_steps), chaos.faults))
    faults = []
    for number, step in enumerate(steps):
        rank = rng.randrange(1 << 16)  # taken modulo the world size when the step comes
        kind = rng.choice(chaos.kinds)
        if kind == "kill" and checkpoint_every and step % checkpoint_every == 0:
            faults.append(Fault("kill", rank, step=step, at="checkpoint", chaos=number))
        elif kind == "slow":
            faults.append(
                Fault(
                    "slow",
                    rank,
                    step=step,
                    steps=rng.randint(1, 3),
                    delay=round(rng.uniform(0.2, 0.8), 2),
                    chaos=number,
                )
            )
        else:
            faults.append(Fault(kind, rank, step=step, chaos=number))
    return faults
