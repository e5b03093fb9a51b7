"""Safe unpickling of what a checkpoint stores as pickles: DCP's index and its objects.

DCP unpickles ``.metadata`` and the non-tensor items (the registry's items, the
optimizer's hyperparameters) with ``pickle.load`` and ``torch.load(weights_only=False)``,
which run whatever a pickle names. llmtrain reads them through unpicklers that know only
plain values and the classes DCP's index is made of: :class:`MetadataUnpickler` for
``.metadata`` (:meth:`.shard_read.ShardReader.read_metadata`), :func:`stored_object` for
an object, and :class:`PlainObjectsPlanner` to decode the objects of a load DCP plans as
a load in place decodes them.
"""

from __future__ import annotations

import io
import pickle
import struct

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner


class _PlainUnpickler(pickle.Unpickler):
    """Knows only plain values (numbers, strings, tuples, lists, dicts, None), bytes and
    ``io.BytesIO``: what DCP's saved hyperparameters and byte items are made of. Anything
    else (a tensor, any other class) is refused, so nothing but those two constructors
    can be called: a narrower set than torch's ``weights_only`` unpickler allows."""

    ALLOWED = {("_io", "BytesIO"), ("io", "BytesIO"), ("_codecs", "encode")}  # encode: bytes

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not a plain value")
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("a tensor is not a plain value")


class MetadataUnpickler(_PlainUnpickler):
    """DCP's ``.metadata``: plain values and the classes its index is made of (dataclasses
    of plain fields, ``torch.Size``, a dtype or layout by its name, an enum; the path DCP's
    stock ``FileSystemWriter`` records), nothing else. DCP itself unpickles it with
    ``pickle.load``, which calls whatever a pickle names."""

    ALLOWED = _PlainUnpickler.ALLOWED | {
        ("torch.distributed.checkpoint.metadata", name) for name in (
            "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
            "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
            "_MEM_FORMAT_ENCODING")} | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
        ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")} | {
        ("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


class PlainObjectsPlanner(DefaultLoadPlanner):
    """DCP's load planner, but the stored objects (the registry's items, the optimizer's
    hyperparameters) are decoded by :func:`stored_object`, as a load in place decodes
    them, where DCP's runs ``torch.load(weights_only=False)``, which calls whatever a
    pickle names."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        """Puts the stored object ``value``, decoded, where ``read_item`` goes."""
        decoded = stored_object(value.getvalue())
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                        decoded)
        else:
            self.state_dict[read_item.dest_index.fqn] = decoded


_DECODED: dict[bytes, object] = {}  # plain immutable values decoded, by their stored bytes
_DECODED_MAX = 4096
_PLAIN = (int, float, complex, bool, str, bytes, type(None))


def stored_object(data: bytes):
    """A non-tensor item as DCP stores it (a ``torch.save`` archive): its pickle read by
    :class:`_PlainUnpickler` straight from the archive, about 7x cheaper than opening it
    with torch's archive reader and 100x cheaper than ``torch.load``, whose per-call setup
    was most of the cost of a restart's two dozen small items (the optimizer's
    hyperparameters); an item holding anything else (tensors, in checkpoints written
    before the RNG state was plain values) goes to ``torch.load(weights_only=True)``.
    An immutable value (a number, a string, a tuple of them: the hyperparameters, most
    the same in every checkpoint of a run) is kept by its bytes and not decoded again
    (a dict lookup against about 9 us a decode here)."""
    try:
        return _DECODED[data]
    except KeyError:
        pass
    try:
        # buffered: from a bare BytesIO the unpickler reads opcode by opcode (4x slower)
        value = _PlainUnpickler(io.BufferedReader(io.BytesIO(_pickle_record(data)))).load()
    except Exception:  # what it cannot read, torch.load reads, refuses or explains
        with torch.serialization.safe_globals([io.BytesIO]):
            return torch.load(io.BytesIO(data), weights_only=True)
    if _immutable(value):
        if len(_DECODED) >= _DECODED_MAX:
            _DECODED.clear()
        _DECODED[bytes(data)] = value
    return value


def _immutable(value) -> bool:
    return isinstance(value, _PLAIN) or (type(value) is tuple and all(map(_immutable, value)))


_ZIP_ENTRY = struct.Struct("<4s4xH16xHH")  # a zip entry's header: magic, method, name, extra


def _pickle_record(data: bytes):
    """The ``data.pkl`` record of a ``torch.save`` archive. torch writes it first and
    uncompressed, so it starts right after the first entry's header; its length is in a
    descriptor after it, but a pickle ends itself (STOP). Any other layout goes through
    torch's archive reader."""
    magic, method, name_len, extra_len = _ZIP_ENTRY.unpack_from(data)
    name_end = _ZIP_ENTRY.size + name_len
    if (magic == b"PK\x03\x04" and method == 0
            and bytes(data[_ZIP_ENTRY.size:name_end]).endswith(b"/data.pkl")):
        return memoryview(data)[name_end + extra_len:]
    return torch._C.PyTorchFileReader(io.BytesIO(data)).get_record("data.pkl")
