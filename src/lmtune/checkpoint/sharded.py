"""Reading ``torch.distributed.checkpoint`` folders without running code from them.

DCP writes its index (``.metadata``) with plain pickle and reads non-tensor values (optimizer
hyperparameters) with ``torch.load(weights_only=False)``: a crafted checkpoint would run code on an
ordinary ``--resume``. Here the index is unpickled with an allow-list of the classes DCP's index is
made of (nothing else can be named, so nothing else can be called), its file references must stay
inside the folder, and every stored value goes through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from lmtune.errors import UserError

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}
_SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")


class _IndexUnpickler(pickle.Unpickler):
    """Resolves only the exact (module, name) pairs of DCP's index classes and torch dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which a checkpoint index never holds")


def read_index(folder: Path) -> Metadata:
    """The checked index of the DCP folder ``folder``.

    Raises:
        UserError: when the index names anything but DCP's own classes, or files outside the folder.
    """
    path = folder / ".metadata"
    try:
        with path.open("rb") as f:
            index = _IndexUnpickler(f).load()
    except FileNotFoundError:
        raise UserError(f"{path}: missing (not a complete sharded checkpoint)") from None
    except Exception as e:  # any unpickling failure means the same: not an index we wrote
        raise UserError(f"{path}: refused, not a checkpoint index lmtune can read safely ({e})") from None
    if not isinstance(index, Metadata) or not isinstance(index.storage_data, dict):
        raise UserError(f"{path}: refused, not a checkpoint index ({type(index).__name__})")
    for info in index.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not _SHARD_FILE.fullmatch(name):
            raise UserError(f"{path}: refused, it points at {name!r}, not a shard file of this folder")
        if getattr(info, "transform_descriptors", None):
            raise UserError(f"{path}: refused, it asks for stream transforms {info.transform_descriptors}")
    return index


class SafeReader(FileSystemReader):
    """DCP's file reader with the checked index above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise UserError(f"{self.path}: per-rank index files are not supported")
        index = read_index(Path(self.path))
        index.storage_meta = StorageMeta(load_id=self.load_id)
        return index


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor values (optimizer hyperparameters) are read as data, never as pickled objects."""

    refused = ""  # why a stored value was refused (DCP wraps the exception itself)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            why = str(e).split("WeightsUnpickler error: ")[-1].splitlines()[0]
            self.refused = f"the stored value {read_item.dest_index.fqn} is not plain data ({why})"
            raise
        safe = io.BytesIO()
        torch.save(loaded, safe)  # hand DCP's own code a stream that holds only what was checked
        safe.seek(0)
        super().load_bytes(read_item, safe)


def load(state: dict[str, Any], folder: Path, *, no_dist: bool, allow_partial: bool = False) -> None:
    """Fill ``state`` in place from the DCP folder ``folder``, reading it safely."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    read_index(folder)  # DCP turns a reader's error into a logged warning; ours is the message
    planner = SafeLoadPlanner(allow_partial_load=allow_partial)
    try:
        with warnings.catch_warnings():  # DCP warns of one process, which no_dist says we meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(state, storage_reader=SafeReader(str(folder)), planner=planner, no_dist=no_dist)
    except CheckpointException:
        if planner.refused:
            raise UserError(f"{folder}: refused, {planner.refused}") from None
        raise
