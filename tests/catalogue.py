"""A session-wide catalogue of finished `gradmesh train` runs, memoised on normalised arguments.

Most multi-process tests only read a run's outputs (weights, metrics, sample records,
checkpoints). The same run is asked for by many of them — the single-process references, the
2-rank data-parallel run, the 10-step runs that resume tests continue — so each is computed once
per session and its directory shared. A catalogued directory is read-only: a test that resumes
or damages a run works on `copy_run(...)` of it, and `Catalogue.changed()` lets the harness
notice a test that wrote into one anyway.
"""

import shutil
from pathlib import Path

from helpers import TINY, train

# Flags that may appear more than once and accumulate (all others: the last one wins).
REPEATABLE = {"--inject"}


def _pairs(args: tuple[str, ...]) -> list[tuple[str, str | None]]:
    """(flag, value) pairs; a flag followed by another flag (or nothing) is a switch."""
    pairs, i = [], 0
    while i < len(args):
        flag = args[i]
        assert flag.startswith("--"), f"expected a --flag, got {flag!r} in {args}"
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            pairs.append((flag, args[i + 1]))
            i += 2
        else:
            pairs.append((flag, None))
            i += 1
    return pairs


def normalise(nproc: int, args: tuple[str, ...], tiny: bool = True) -> tuple:
    """The run's identity: nproc and the (flag, value) pairs, independent of their order.

    `--set k=v` is keyed by k (a later value wins, as in gradmesh), `--inject` accumulates, and
    any other flag given twice keeps its last value — so TINY's settings can be overridden."""
    settings: dict[tuple[str, str], str | None] = {}
    repeated: list[tuple[str, str | None]] = []
    for flag, value in _pairs(tuple(TINY if tiny else ()) + tuple(args)):
        if flag == "--set":
            key, _, setting = (value or "").partition("=")
            settings[("--set", key.strip())] = setting.strip()
        elif flag in REPEATABLE:
            repeated.append((flag, value))
        else:
            settings[(flag, "")] = value
    return nproc, tuple(sorted(settings.items(), key=repr)), tuple(sorted(repeated, key=repr))


def _fingerprint(run_dir: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


class Catalogue:
    """`run(nproc, *args, tiny=True)` -> the directory of a finished run, trained at most once."""

    def __init__(self, root: Path, trainer=train):
        self.root = Path(root)
        self._train = trainer  # helpers.train: the real CLI in a subprocess
        self._runs: dict[tuple, Path] = {}
        self._failed: dict[tuple, Exception] = {}
        self._fingerprints: dict[Path, dict] = {}

    def run(self, nproc: int, *args: str, tiny: bool = True) -> Path:
        key = normalise(nproc, args, tiny)
        if key in self._failed:  # every test that needs a broken run fails at once, not after retraining it
            raise AssertionError(f"this catalogued run failed earlier in the session:\n{self._failed[key]}")
        if key not in self._runs:
            run_dir = self.root / f"run-{len(self._runs) + len(self._failed):02d}-n{nproc}"
            try:
                self._train(run_dir, nproc, *args, tiny=tiny)
            except Exception as exc:
                self._failed[key] = exc
                raise
            self._runs[key] = run_dir
            self._fingerprints[run_dir] = _fingerprint(run_dir)
        return self._runs[key]

    def __len__(self) -> int:
        return len(self._runs)

    def changed(self) -> list[Path]:
        """Catalogued directories whose files differ from when their run finished."""
        return [d for d, before in self._fingerprints.items() if _fingerprint(d) != before]


def copy_run(run_dir: Path, to: Path) -> Path:
    """A private, writable copy of a (catalogued) run directory, e.g. to resume it."""
    shutil.copytree(run_dir, to)
    return to
