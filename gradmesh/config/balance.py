"""The `--balance` setting: off, auto, or fixed shares per data-parallel rank (no torch here)."""

from gradmesh.errors import UsageError

ACCEPTED = "off, auto or static:S1,S2,... (one positive share per data-parallel rank, e.g. static:3,1)"


def parse_balance(text: str) -> tuple[str, tuple[float, ...]]:
    """'static:3,1' -> ('static', (0.75, 0.25)); 'off' / 'auto' -> (text, ())."""
    if text in ("off", "auto"):
        return text, ()
    kind, sep, rest = text.partition(":")
    try:
        shares = tuple(float(item) for item in rest.split(","))
    except ValueError:
        shares = ()
    if kind != "static" or not sep or not shares or not all(0 < s < float("inf") for s in shares):
        raise UsageError(f"--balance {text!r} is not one of {ACCEPTED}")
    total = sum(shares)
    return "static", tuple(s / total for s in shares)
