"""Names of the device mesh's axes and the `--mesh` syntax (no torch: the CLI checks it at once)."""

from gradmesh.config.checks import whole
from gradmesh.errors import UsageError

DP_AXIS, FSDP_AXIS, PP_AXIS, TP_AXIS, PS_AXIS = "dp", "fsdp", "pp", "tp", "ps"
"""Axis names, for code that picks an axis: several are also strategies' names, which only the
strategy registry compares (tests/test_architecture.py tells the two apart by these constants)."""
MESH_AXES = (DP_AXIS, FSDP_AXIS, PP_AXIS, TP_AXIS, PS_AXIS)
"""ps: parameter servers and their workers (a role axis; it composes with no other)."""
DATA_AXES = (DP_AXIS, FSDP_AXIS)
"""The axes that split each global batch."""


def parse_mesh(text: str, supported: tuple[frozenset, ...]) -> dict[str, int]:
    """'dp=2,tp=2' -> {'dp': 2, 'tp': 2} (order kept: the first axis is the outermost)."""
    shape: dict[str, int] = {}
    for part in text.split(","):
        axis, sep, size = part.strip().partition("=")
        if not sep or axis not in MESH_AXES or not whole(size) or int(size) < 1 or axis in shape:
            raise UsageError(
                f"--mesh {text!r}: each part must be AXIS=N with AXIS one of "
                f"{', '.join(MESH_AXES)} (each once), e.g. dp=2,tp=2"
            )
        shape[axis] = int(size)
    if frozenset(shape) not in supported:
        accepted = "; ".join(",".join(sorted(s)) for s in supported)
        raise UsageError(
            f"--mesh {text!r} combines {', '.join(shape)}, which gradmesh does not compose yet; "
            f"supported axis sets: {accepted}"
        )
    return shape
