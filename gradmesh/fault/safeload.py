"""Checkpoints read without running what they name: metadata through a restricted unpickler.

DCP's FileSystemReader reads `.metadata` with a plain `pickle.load`, which calls whatever the
pickle names: a checkpoint copied from elsewhere could run code on `gradmesh export` or
`--resume`. Checkpoints are trusted input, but their metadata needs no more than DCP's metadata
dataclasses, torch.Size, dtypes and a layout, so `SafeReader` admits exactly those (the set a
real checkpoint asks for) and refuses anything else by name. DCP's default planner also loads
non-tensor entries with `torch.load(weights_only=False)`; `SafePlanner` first makes them pass
`weights_only=True`. `load` hands both to `dcp.load`, so every read of a checkpoint goes
through them (contract 8). The metadata also names each shard's file, which DCP opens
relative to the checkpoint: a name that is not a plain file name of that folder is refused too.
"""

import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from gradmesh.errors import UsageError

ADMITTED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # how torch pickles a layout (torch.strided)
    "torch": {"Size"} | {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
    "pathlib": {"PosixPath", "PurePosixPath"},  # StorageMeta.checkpoint_id
}


class UnsafeCheckpoint(UsageError):
    """A checkpoint that asks for more than checkpoint data: refused like bad input (exit 2)."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, stream, path):
        super().__init__(stream)
        self.path = path

    def find_class(self, module: str, name: str):
        if name in ADMITTED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(
            f"checkpoint metadata {self.path} names {module}.{name}, which gradmesh does not "
            "load (it admits only torch.distributed.checkpoint's metadata classes)"
        )


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata unpickled by `_MetadataUnpickler`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        # **kwargs kept: DCP falls back to a rank's own metadata file through read_metadata(rank=...).
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream, path).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpoint(f"checkpoint metadata {path} holds a {type(metadata).__name__}, not DCP metadata")
        _check_confined(metadata, path)
        if metadata.storage_meta is None:  # as torch's own read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_confined(metadata: Metadata, path) -> None:
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
            raise UnsafeCheckpoint(
                f"checkpoint metadata {path} names shard file {name!r}, outside the checkpoint's "
                "folder (gradmesh reads only plain file names there)"
            )


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner; a non-tensor entry must load with weights_only=True before DCP
    unpickles it in full (a pickle that passes names nothing weights_only refuses)."""

    def load_bytes(self, read_item, value) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpoint(
                f"checkpoint entry {read_item.dest_index.fqn} is not plain data: {str(exc).splitlines()[0]}"
            ) from None
        value.seek(0)
        super().load_bytes(read_item, value)


def read_metadata(path: str | Path) -> Metadata:
    return SafeReader(str(path)).read_metadata()


def load(state: dict, path: str | Path, **kwargs) -> None:
    """`dcp.load` into `state` (in place) from the checkpoint at `path`, through the safe reader and planner."""
    dcp.load(state, checkpoint_id=str(path), storage_reader=SafeReader(str(path)), planner=SafePlanner(), **kwargs)
