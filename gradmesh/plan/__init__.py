"""Planning: how to cut and place a model, from measured costs."""

from pathlib import Path

from gradmesh import env


def cache_dir() -> Path:
    """Where calibrations are kept: `$XDG_CACHE_HOME/gradmesh/calibration/` (default ~/.cache)."""
    return Path(env.cache_home()) / "gradmesh" / "calibration"


def has_calibration(model: str) -> bool:
    """Whether any calibration of `model` is cached (cheap: no torch, no model built)."""
    return any(cache_dir().glob(f"{model}-*.json"))
