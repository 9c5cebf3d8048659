"""The `--compression` setting: a method and its parameters, parsed and checked without torch."""

from gradmesh.errors import UsageError

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd:rank=R[,start=N]", "topk:ratio=K[,start=N]", "auto")
ACCEPTED = "none, fp16, bf16, powersgd:rank=R[,start=N] (R >= 1, N >= 0), topk:ratio=K[,start=N] (0 < K <= 1) or auto"
PARAMETERS = {
    "none": {},
    "fp16": {},
    "bf16": {},
    "powersgd": {"rank": int, "start": int},
    "topk": {"ratio": float, "start": int},
    "auto": {},
}
REQUIRED = {"powersgd": ("rank",), "topk": ("ratio",)}
DEFAULTS = {"powersgd": {"start": 2}}
"""PowerSGD starts after 2 plain steps: DDP rebuilds its buckets after the first (as torch's own
start_powerSGD_iter must be > 1 for)."""


def parse_compression(text: str) -> tuple[str, dict]:
    """'powersgd:rank=4,start=10' -> ('powersgd', {'rank': 4, 'start': 10}); UsageError if malformed."""
    method, _, rest = text.partition(":")
    if method not in PARAMETERS or (rest and not PARAMETERS[method]):
        raise UsageError(f"--compression {text!r} is not one of {ACCEPTED}")
    found = dict(DEFAULTS.get(method, {}))
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        kind = PARAMETERS[method].get(key)
        try:
            found[key] = kind(value) if kind and sep else None
        except ValueError:
            found[key] = None
        if found[key] is None:
            raise UsageError(
                f"--compression {text!r}: {item!r} is not a valid parameter of {method}; accepted: {ACCEPTED}"
            )
    missing = [key for key in REQUIRED.get(method, ()) if key not in found]
    bad = found.get("rank", 1) < 1 or found.get("start", 0) < 0 or not 0 < found.get("ratio", 1) <= 1
    if missing or bad:
        raise UsageError(f"--compression {text!r} needs {method}'s parameters in range; accepted: {ACCEPTED}")
    return method, found
