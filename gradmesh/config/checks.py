"""The checks every config section's `__post_init__` uses: one line naming the key and what is accepted."""

import dataclasses
import math

from gradmesh.errors import UsageError


def positive(section: str, name: str, value, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else ">= 1"
        raise UsageError(f"{section}.{name} must be {bound}, got {value}")


def finite(section_obj) -> None:
    """No NaN or infinity in any float field: they pass every `<` check and break things later."""
    section = type(section_obj).__name__.removesuffix("Config").lower()
    for f in dataclasses.fields(section_obj):
        value = getattr(section_obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{section}.{f.name} must be a finite number, got {value}")


def one_of(section: str, name: str, value, accepted) -> None:
    if value not in accepted:
        raise UsageError(f"{section}.{name}: {value!r} is not one of {', '.join(map(str, accepted))}")
