"""The compressor registry: one row per `--compression` method, read by everything that needs to
know one (config parsing, the CLI's help, the strategy registry's accepted methods, the reducer
a job builds), without torch.

A row says how the method is written and what its parameters are, which reducer carries it
(a "module:function" imported on first use, like the strategy registry's functions), the dtype
it narrows gradients to if it is a plain cast (what FSDP2's reduce dtype and parameter-server
pushes can take), and which step-engine families' gradients it can carry.

Adding a compressor: write its reducer (a `gradmesh.comm.reducer.Reducer`; an error-feedback
one subclasses `gradmesh.comm.feedback.ErrorFeedback`) and a function building it from the
parsed parameters, then add a row here.
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from gradmesh.errors import UsageError

EVERY_FAMILY = ("collective", "pipeline", "ps")
"""Step-engine families (`gradmesh.engine.ENGINES`) whose gradients a cast can narrow."""
THROUGH_THE_REDUCER = ("collective", "pipeline")
"""Families whose data-parallel gradients go through the job's reducer with each parameter's place
in the bucket (what error feedback keeps its residual by)."""


@dataclass(frozen=True)
class Compressor:
    name: str
    help: str
    """Its entry in `--compression`'s help."""
    syntax: str = ""
    """How its parameters are written after the name, e.g. ':rank=R[,start=N]'."""
    ranges: str = ""
    """The parameters' accepted ranges, as the error messages quote them."""
    parameters: dict[str, type] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    defaults: dict[str, object] = field(default_factory=dict)
    in_range: Callable[[dict], bool] = lambda found: True
    reducer: str | None = None
    """'module:function': (parameters) -> the job's base reducer; None: the plain fp32 mean."""
    wire_dtype: str | None = None
    """A plain cast: the torch dtype (by name) every gradient travels in."""
    families: tuple[str, ...] = THROUGH_THE_REDUCER
    """The step-engine families whose gradients it can carry."""
    error_feedback: bool = False
    """It sends a summary and keeps what it left out for the next step (per-parameter residuals)."""
    auto_setting: str | None = None
    """The setting `--compression auto` picks it by on a slow link (`gradmesh.comm.auto.decide`:
    the error-feedback one where its matrices shrink most of the model, else the plain cast)."""

    @property
    def usage(self) -> str:
        return self.name + self.syntax

    def build(self, parameters: dict):
        """The reducer this method's gradients travel by (its module imported only now: torch)."""
        if self.reducer is None:
            return None
        module, _, name = self.reducer.partition(":")
        return getattr(importlib.import_module(module), name)(self, parameters)


ROWS = (
    Compressor("none", "none (fp32, default)", families=(*EVERY_FAMILY, "actor-learner")),
    Compressor(
        "fp16",
        "fp16 (half the bytes)",
        reducer="gradmesh.comm.compress:cast_all_reduce",
        wire_dtype="float16",
        families=EVERY_FAMILY,
    ),
    Compressor(
        "bf16",
        "bf16 (half the bytes, fp32's range)",
        reducer="gradmesh.comm.compress:cast_all_reduce",
        wire_dtype="bfloat16",
        families=EVERY_FAMILY,
        auto_setting="bf16",
    ),
    # PowerSGD starts after 2 plain steps: DDP rebuilds its buckets after the first (as torch's
    # own start_powerSGD_iter must be > 1 for).
    Compressor(
        "powersgd",
        "powersgd:rank=R[,start=N] (low rank, with error feedback)",
        syntax=":rank=R[,start=N]",
        ranges=" (R >= 1, N >= 0)",
        parameters={"rank": int, "start": int},
        required=("rank",),
        defaults={"start": 2},
        in_range=lambda found: found["rank"] >= 1 and found["start"] >= 0,
        reducer="gradmesh.comm.feedback:powersgd",
        error_feedback=True,
        auto_setting="powersgd:rank=4",
    ),
    Compressor(
        "topk",
        "topk:ratio=K[,start=N] (the largest K of each gradient, with error feedback)",
        syntax=":ratio=K[,start=N]",
        ranges=" (0 < K <= 1)",
        parameters={"ratio": float, "start": int},
        required=("ratio",),
        in_range=lambda found: found.get("start", 0) >= 0 and 0 < found["ratio"] <= 1,
        reducer="gradmesh.comm.feedback:topk",
        error_feedback=True,
    ),
    Compressor(
        "auto",
        "auto (measured after the first steps: none, bf16 or powersgd)",
        reducer="gradmesh.comm.auto:auto_compression",
    ),
)
COMPRESSORS = {row.name: row for row in ROWS}
COMPRESSIONS = tuple(row.usage for row in ROWS)
WIRE_DTYPES = {row.name: row.wire_dtype for row in ROWS if row.wire_dtype}
"""The plain casts: method -> torch dtype name (FSDP2's reduce dtype, a push's width)."""


def accepted() -> str:
    """Every method, as the error messages list them."""
    described = [row.usage + row.ranges for row in ROWS]
    return f"{', '.join(described[:-1])} or {described[-1]}"


def help_text() -> str:
    described = [row.help for row in ROWS]
    return f"data-parallel gradients on the wire: {', '.join(described[:-1])} or {described[-1]}"


def parse_compression(text: str) -> tuple[str, dict]:
    """'powersgd:rank=4,start=10' -> ('powersgd', {'rank': 4, 'start': 10}); UsageError if malformed."""
    method, _, rest = text.partition(":")
    row = COMPRESSORS.get(method)
    if row is None or (rest and not row.parameters):
        raise UsageError(f"--compression {text!r} is not one of {accepted()}")
    found = dict(row.defaults)
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        kind = row.parameters.get(key)
        try:
            found[key] = kind(value) if kind and sep else None
        except ValueError:
            found[key] = None
        if found[key] is None:
            raise UsageError(
                f"--compression {text!r}: {item!r} is not a valid parameter of {method}; accepted: {accepted()}"
            )
    missing = [key for key in row.required if key not in found]
    if missing or not row.in_range(found):
        raise UsageError(f"--compression {text!r} needs {method}'s parameters in range; accepted: {accepted()}")
    return method, found
