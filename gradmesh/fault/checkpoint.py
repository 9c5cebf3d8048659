"""Checkpoints through torch.distributed.checkpoint (DCP), published atomically.

Layout: `RUN_DIR/checkpoints/step-N/` holds DCP's shard files and `.metadata`, plus
`trainer_state.json` (step, sampler position, the config that shapes model and data, and the
checksums of every file, its own included: fault.integrity). Each rank writes its own shard
into `.tmp-step-N/`; only when every rank has finished does rank 0 add trainer_state.json and
rename the folder to `step-N`. A rename is atomic on one file system, so a crash mid-write
leaves a `.tmp-*` folder that is ignored and cleaned up later. A published checkpoint damaged
afterwards (a truncated, altered or unsealed file) fails verification and the newest intact one
is used instead, with a one-line note (`latest_good_checkpoint`). Every file and folder is
recorded in the run's manifest before it is made, and removed only through it (pruning, a
rewrite of the same step), so a user's files among the checkpoints are never deleted.

State dicts are keyed by fully qualified parameter names whatever the strategy (the step
engine's `checkpoint_state`, which asks the strategy registry), and DCP reshards on load, so a
checkpoint written by any strategy at any world size loads under any other.
"""

import json
import os
import re
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from gradmesh import manifest
from gradmesh.fault import safeload
from gradmesh.fault.integrity import STATE_FILE, file_digests, seal, verify  # noqa: F401 (the checkpoint API)
from gradmesh.files import fsync_dir

STEP_FOLDER = re.compile(r"step-(0|[1-9][0-9]*)")
"""A published checkpoint's folder: ASCII digits as `str(step)` writes them (never `step-²`, `step-05`)."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _step_of(path: Path) -> int:
    return int(path.name.split("-", 1)[1])


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Published checkpoints, newest first (not yet verified)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.glob("step-*")
        if STEP_FOLDER.fullmatch(p.name) and (p / STATE_FILE).is_file() and (p / ".metadata").is_file()
    ]
    return sorted(found, key=_step_of, reverse=True)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[0] if found else None


def read_state(path: Path) -> dict:
    return json.loads((path / STATE_FILE).read_text())


def latest_good_checkpoint(run_dir: str | Path, warn=print) -> Path | None:
    """The checkpoint to go back to: the newest one of `run_dir` that passes `verify` (every file,
    the state file included, matches its checksums), or None when there is none. Each damaged
    newer one is skipped with one line to `warn`. Resume, restarts, export and rollback all
    choose through this one function."""
    for path in complete_checkpoints(run_dir):
        problem = verify(path)
        if problem is None:
            return path
        warn(f"gradmesh: checkpoint {path} is damaged ({problem}); trying the previous one")
    return None


class Checkpointer:
    """Writes checkpoints for one run; with `use_async`, training goes on during the write.

    Collective over `group`: every rank calls `save`, `wait` and `load` in the same order. The
    state comes from an object with `checkpoint_state(for_load)` and `install_checkpoint(payload)`
    (a step engine). Coordination runs on a gloo group of its own (the topology's "checkpoint"
    side group): async writes' background collectives never interleave with training's (DCP's
    advice for async_save), and small CPU tensors work even when training runs on NCCL.
    """

    def __init__(
        self,
        run_dir: str | Path,
        group,
        is_main: bool,
        keep: int = 0,
        use_async: bool = False,
        on_written: Callable[[int], None] = lambda step: None,
    ):
        self.root = checkpoint_root(run_dir)
        self.keep, self.use_async = keep, use_async
        self.on_written = on_written
        """Called as a write starts, once every rank has entered it (fault injection's hook)."""
        self.is_main, self.group = is_main, group
        self.pending: tuple[int, dict, Future] | None = None

    def save(self, step: int, source, state: dict) -> None:
        self.wait()  # one write in flight at a time
        tmp = self.root / f".tmp-step-{step}"
        if self.is_main:
            self._make_folder(tmp)
        dist.barrier(group=self.group)
        payload = source.checkpoint_state()
        # Fault injection's kill lands here: the other ranks are inside DCP's collectives, so a
        # peer that is lost mid-write is lost while they wait on it (its own shard never written).
        self.on_written(step)
        if self.use_async:
            future = dcp.async_save(payload, checkpoint_id=str(tmp), process_group=self.group)
            # Only a non-blocking stager (none is given) makes it return an AsyncSaveResponse.
            assert isinstance(future, Future)
            self.pending = (step, state, future)
        else:
            dcp.save(payload, checkpoint_id=str(tmp), process_group=self.group)
        if not self.use_async:
            self._publish(step, state)

    def wait(self) -> None:
        """Finish (and publish) an async write in flight; its failure is raised here."""
        if self.pending is None:
            return
        step, state, future = self.pending
        self.pending = None
        error = None
        try:
            future.result()
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            error = exc
        failed = torch.tensor([1 if error else 0])
        dist.all_reduce(failed, group=self.group)
        if failed.item():
            raise CheckpointError(
                f"async checkpoint of step {step} failed on {int(failed.item())} rank(s)"
                + (f": {_root_cause(error)}" if error else "")
            ) from error
        self._publish(step, state)

    def _publish(self, step: int, state: dict) -> None:
        dist.barrier(group=self.group)  # every rank's shard is on disk
        if self.is_main:
            tmp, final = self.root / f".tmp-step-{step}", self.root / f"step-{step}"
            state = seal(state, tmp)
            manifest.record(self.run_dir, final, kind="dir")
            manifest.record(self.run_dir, *(final / name for name in [*state["files"], STATE_FILE]))
            with open(tmp / STATE_FILE, "w") as handle:
                json.dump(state, handle, indent=1)
                handle.flush()
                os.fsync(handle.fileno())
            self._remove(final.name)  # this step written before (a rerun after a restart)
            try:
                os.replace(tmp, final)
            except OSError as exc:  # a user's file kept it from going
                raise CheckpointError(f"cannot publish {final}: {exc.strerror}; move its content away") from None
            fsync_dir(self.root)
            self._prune(final)
        dist.barrier(group=self.group)

    @property
    def run_dir(self) -> Path:
        return self.root.parent

    def _make_folder(self, tmp: Path) -> None:
        """An empty working folder for one write, recorded as gradmesh's whole before it exists."""
        if not self.root.is_dir():
            manifest.record(self.run_dir, self.root, kind="dir")
            self.root.mkdir(parents=True, exist_ok=True)
        self._remove(tmp.name)
        manifest.record(self.run_dir, tmp, kind="tree")
        try:
            tmp.mkdir()
        except FileExistsError:
            raise CheckpointError(
                f"{tmp} is in the way and not listed as gradmesh's in the run's manifest; move it away"
            ) from None

    def _remove(self, name: str) -> None:
        manifest.remove(self.run_dir, under=f"{self.root.name}/{name}")

    def _prune(self, published: Path | None = None) -> None:
        """Drop abandoned writes, and checkpoints older than the `keep` newest intact ones:
        damaged ones are never counted, so the newest intact checkpoint is never removed."""
        for stale in self.root.glob(".tmp-step-*"):
            if self.pending is None or stale.name != f".tmp-step-{self.pending[0]}":
                self._remove(stale.name)
        if self.keep <= 0:
            return
        intact = 0
        for path in complete_checkpoints(self.run_dir):
            if intact >= self.keep:
                self._remove(path.name)
            elif path == published or verify(path) is None:  # the one just sealed is not read again
                intact += 1

    def load(self, path: Path, target) -> dict:
        """Load model and optimizer state in place from `path`; returns its trainer state."""
        payload = target.checkpoint_state(for_load=True)
        comm = comm_targets(path, dist.get_rank())
        if comm:
            payload["comm"] = comm
        try:
            safeload.load(payload, path, process_group=self.group)
        except (Exception, CheckpointException) as exc:
            raise CheckpointError(describe_load_error(path, exc)) from exc
        target.install_checkpoint(payload)
        return read_state(path)


def _root_cause(error: BaseException) -> str:
    """One line for an error; DCP's CheckpointException carries each rank's own failure."""
    failures = getattr(error, "failures", None)
    if failures:
        first = next(iter(failures.values()))  # (exception, traceback frames) per rank
        error = first[0] if isinstance(first, tuple) else first
    return f"{type(error).__name__}: {error}".splitlines()[0]


def saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the model tensors in a checkpoint (from DCP's metadata)."""
    return {
        key.removeprefix("model."): tuple(meta.size)
        for key, meta in safeload.read_metadata(path).state_dict_metadata.items()
        if key.startswith("model.") and hasattr(meta, "size")
    }


def comm_targets(path: Path, rank: int) -> dict:
    """Tensors to load rank `rank`'s reducer state into, shaped as the checkpoint holds them
    (error feedback is each rank's own; a checkpoint written without it gives none)."""
    prefix = f"comm.rank{rank}."
    found = {
        key.removeprefix(prefix): torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in safeload.read_metadata(path).state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    return {f"rank{rank}": found} if found else {}


def shape_mismatches(saved: dict[str, tuple], current: dict[str, tuple]) -> list[str]:
    problems = [
        f"{name} {list(saved[name])} in checkpoint vs {list(shape)} now"
        for name, shape in current.items()
        if name in saved and tuple(saved[name]) != tuple(shape)
    ]
    problems += [f"{name} missing from checkpoint" for name in current if name not in saved]
    problems += [f"{name} not in this model" for name in saved if name not in current]
    return problems


def describe_load_error(path: Path, exc: BaseException) -> str:
    text = str(exc)
    if "size mismatch" in text or "shape" in text.lower():
        return f"checkpoint {path} does not fit this model: {text.splitlines()[-1][:400]}"
    return f"checkpoint {path} could not be loaded: {text.splitlines()[-1][:400] if text else type(exc).__name__}"
