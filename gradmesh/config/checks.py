"""The checks every config section's `__post_init__` uses: one line naming the key and what is accepted."""

import dataclasses
import math
import re

from gradmesh.errors import UsageError

INT64 = 2**63
WHOLE = re.compile(r"[0-9]{1,18}")
"""A whole number in ASCII digits below 10^18: str.isdigit() takes every script's digits ("²" too,
which int() refuses), and int() refuses more than 4300 digits."""


def positive(section: str, name: str, value, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else ">= 1"
        raise UsageError(f"{section}.{name} must be {bound}, got {value}")


def finite(section_obj) -> None:
    """No NaN or infinity in any float field (they pass every `<` check and break things later),
    and no whole number past 64 bits (torch's counters and TOML's integers end there)."""
    section = type(section_obj).__name__.removesuffix("Config").lower()
    for f in dataclasses.fields(section_obj):
        value = getattr(section_obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{section}.{f.name} must be a finite number, got {value}")
        if isinstance(value, int) and not -INT64 <= value < INT64:
            raise UsageError(f"{section}.{f.name} must lie in [-2^63, 2^63), got {value}")


def one_of(section: str, name: str, value, accepted) -> None:
    if value not in accepted:
        raise UsageError(f"{section}.{name}: {value!r} is not one of {', '.join(map(str, accepted))}")


def fraction(section: str, name: str, value: float, low: float = 0.0, high: float = 1.0) -> None:
    """A value in [low, high)."""
    if not low <= value < high:
        raise UsageError(f"{section}.{name} must be in [{low:g}, {high:g}), got {value}")


def whole(text: str) -> bool:
    return WHOLE.fullmatch(text) is not None


def trace_steps(text: str) -> None:
    """'A' or 'A:B' with 1 <= A <= B, in ASCII digits."""
    first, sep, last = text.partition(":")
    if not (whole(first) and (not sep or whole(last))) or int(first) < 1 or (sep and int(last) < int(first)):
        raise UsageError(f"--trace-steps {text!r}: expected A:B with 1 <= A <= B (steps to trace), e.g. 5:8")


def rendezvous(launch) -> None:
    """How the machines of a job find each other: the endpoint, the node ranks and the job id."""
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        raise UsageError("launch.nnodes > 1 needs --rdzv-endpoint HOST:PORT")
    host, _, port = launch.rdzv_endpoint.rpartition(":")
    if launch.rdzv_endpoint and not (host and whole(port) and 1 <= int(port) <= 65535):
        raise UsageError(
            f"--rdzv-endpoint {launch.rdzv_endpoint!r}: expected HOST:PORT with PORT from 1 to 65535, "
            "e.g. 10.0.0.1:29400"
        )
    if not -1 <= launch.node_rank < launch.nnodes:
        raise UsageError(
            f"--node-rank {launch.node_rank}: a job of {launch.nnodes} machine(s) has node ranks "
            f"0..{launch.nnodes - 1} (or -1: assigned by the rendezvous)"
        )
    if launch.rdzv_backend == "static" and launch.nnodes > 1 and launch.node_rank < 0:
        raise UsageError("--rdzv-backend static needs --node-rank R on every machine (0..nnodes-1)")
    bad = [
        item
        for item in launch.rdzv_conf.split(",")
        if (item and not item.partition("=")[0].strip()) or (item and "=" not in item)
    ]
    if bad:
        raise UsageError(
            f"--rdzv-conf {launch.rdzv_conf!r}: expected key=value pairs separated by commas, "
            "e.g. is_host=true,join_timeout=600"
        )
    if not launch.rdzv_id.strip():
        raise UsageError("launch.rdzv_id is empty: give --rdzv-id ID, the same on every machine of the job")
