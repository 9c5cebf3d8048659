"""Config layers: TOML files, command-line flags and --set values merged onto the defaults."""

import dataclasses
import tomllib
import typing
from pathlib import Path

from gradmesh.config.sections import Config
from gradmesh.errors import UsageError
from gradmesh.paths import checked

# Every field of Config is a section made by its class, so the default factory is that class.
SECTIONS: dict[str, type] = {f.name: typing.cast(type, f.default_factory) for f in dataclasses.fields(Config)}

MODEL_DEFAULTS: dict[str, dict[str, dict]] = {
    # A click log of 3 x 10^6 samples wants bigger batches than a character model: one epoch of
    # it (2.7 x 10^6 training samples) gets near the AUC ceiling in little time
    # (docs/benchmarks.md#recsys-default).
    "recsys": {"train": {"global_batch_size": 512, "max_steps": 5400}},
    # ResNet-18 on 16-pixel shapes: AdamW at the default lr, 400 steps of 64 (1.2 epochs of the
    # 21,600 training images, the cosine decay over exactly those) pass 95% held-out accuracy in
    # a few minutes on 2 CPU cores (docs/getting-started.md#resnet-shapes).
    "resnet": {"model": {"samples": 24_000}, "train": {"global_batch_size": 64, "max_steps": 400, "decay_steps": 400}},
    # CartPole-v1 by actors and learners (docs/reinforcement-learning.md): the actor-learner strategy,
    # a small MLP, a constant learning rate (max_steps caps the learner updates; the run ends at
    # rl.target_return), and a lost actor dropped in place while the learners go on.
    "rl-cartpole": {
        "model": {"hidden": 64},
        "train": {"strategy": "impala", "lr": 1e-2, "max_steps": 20_000},
        "checkpoint": {"every": 250},
        "fault": {"recovery": "inplace"},
    },
}
"""Defaults that differ by built-in model, under whatever a layer sets."""


def section_fields(section: str) -> dict[str, type]:
    cls = SECTIONS[section]
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def all_keys() -> list[str]:
    return [f"{s}.{k}" for s in SECTIONS for k in section_fields(s)]


def _coerce(key: str, kind: type, raw):
    """Turn a TOML value or a --set string into the field's type."""
    if isinstance(raw, str) and kind is not str:
        text = raw.strip()
        if kind in (int, float) and not text.isascii():  # int() takes any script's digits
            raise UsageError(f"{key}={raw!r} is not a valid {kind.__name__} (ASCII digits only)")
        try:
            if kind is bool:
                lowered = text.lower()
                if lowered not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return lowered in ("true", "1", "yes")
            return kind(text)
        except ValueError:
            raise UsageError(f"{key}={raw!r} is not a valid {kind.__name__}") from None
    if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if not isinstance(raw, kind) or (kind is int and isinstance(raw, bool)):
        raise UsageError(f"{key}={raw!r} is not a valid {kind.__name__}")
    return raw


def build(layers: list[dict[str, dict]]) -> Config:
    """Merge {section: {key: value}} layers (later wins) onto the defaults and validate."""
    merged: dict[str, dict] = {s: {} for s in SECTIONS}
    for layer in layers:
        for section, values in layer.items():
            if section not in SECTIONS:
                raise UsageError(f"unknown config section {section!r}; accepted: {', '.join(SECTIONS)}")
            if not isinstance(values, dict):
                raise UsageError(f"config section [{section}] must be a table")
            kinds = section_fields(section)
            for key, raw in values.items():
                if key not in kinds:
                    raise UsageError(
                        f"unknown config key {section}.{key}; accepted: " + ", ".join(f"{section}.{k}" for k in kinds)
                    )
                merged[section][key] = _coerce(f"{section}.{key}", kinds[key], raw)
    model = merged["model"].get("name", SECTIONS["model"]().name)
    for section, values in MODEL_DEFAULTS.get(model, {}).items():
        merged[section] = {**values, **merged[section]}
    return Config(**{s: SECTIONS[s](**merged[s]) for s in SECTIONS})


def load_toml(path: str | Path) -> dict[str, dict]:
    path = checked(path, "config file", "a TOML file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"config file {str(path)!r} cannot be read: {exc}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"config file {str(path)!r} is not valid TOML: {exc}") from None


def parse_sets(assignments: list[str]) -> dict[str, dict]:
    """--set section.key=value pairs as a layer."""
    layer: dict[str, dict] = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise UsageError(f"--set {item!r} must look like section.key=value, e.g. model.n_layer=8")
        if section not in SECTIONS or name not in section_fields(section):
            raise UsageError(f"unknown --set key {key.strip()!r}; accepted: {', '.join(all_keys())}")
        layer.setdefault(section, {})[name] = value
    return layer
