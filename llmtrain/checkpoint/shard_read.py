"""The DCP storage reader of llmtrain's checkpoints, raw format and stock.

A checkpoint written by :func:`.shard_write.write_shards` stores each tensor as its bare
bytes at a place its ``_StorageInfo`` names. :class:`ShardReader` reads a load DCP plans
by positional range reads straight into the destination tensors' memory (a scratch buffer
and one copy only when the destination's layout or dtype differ, as in some reshardings),
on several threads (:mod:`llmtrain.checkpoint.range_read`). Items without the descriptor
:data:`.index.RAW` (checkpoints written before this format, or in DCP's own format) are
read by DCP's stock reader, so old checkpoints load. A restart at the world size of the
save skips DCP's planning (:mod:`llmtrain.checkpoint.in_place`) and finds its own items
through :meth:`ShardReader.own_section`.

Where DCP unpickles ``.metadata`` as it is, which runs whatever a pickle names, this reader
reads it through an unpickler of DCP's index (:meth:`ShardReader.read_metadata`,
:mod:`llmtrain.checkpoint.safe_unpickle`). Stock ``FileSystemReader``/``FsspecReader``
refuse raw files (unknown extension ``llmtrain-raw``): pass a :class:`ShardReader` to
``torch.distributed.checkpoint.load``, and use :func:`load_unsharded` for what DCP's
``format_utils.dcp_to_torch_save`` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import pickle
import posixpath
from typing import Callable, NamedTuple

import fsspec
import numpy as np
import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from llmtrain import collector
from llmtrain.checkpoint import checksum, direct_io, index
from llmtrain.checkpoint.index import (INDEX, ITEMS, RAW, Items, Section, StoredItem,
                                       metadata_items)
from llmtrain.checkpoint.range_read import Places, read_scheduled, schedule_reads
from llmtrain.checkpoint.safe_unpickle import MetadataUnpickler, PlainObjectsPlanner
from llmtrain.fsio import is_local


def item_sum(info: _StorageInfo | StoredItem) -> tuple[str, str] | None:
    """(algorithm, hex digest) of the checksum recorded for a stored item; None in
    checkpoints older than item sums."""
    return next(filter(None, map(checksum.parse, info.transform_descriptors or ())), None)


class DamagedCheckpoint(Exception):
    """Items read back whose bytes differ from their recorded sums, or an index that is not
    one DCP writes: a verified verdict on the checkpoint (not a read error), one problem
    per item."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def _slab(sizes, offsets, lengths) -> tuple[int, tuple[int, ...]]:
    """The smallest C-order contiguous run of a chunk of ``sizes`` holding the sub-box
    (``offsets``, ``lengths``): (first element, shape of the run). It is the box itself
    when every dimension after its first non-unit one is whole; else the box's rows."""
    n = len(sizes)
    strides = [math.prod(sizes[i + 1:]) for i in range(n)]
    first = next((i for i in range(n) if lengths[i] != 1), n)
    if all(lengths[j] == sizes[j] for j in range(first + 1, n)):
        return sum(o * s for o, s in zip(offsets, strides)), tuple(lengths)
    return offsets[0] * strides[0], (lengths[0], *sizes[1:])


class _File(NamedTuple):
    """A file of a checkpoint opened for small reads (see :meth:`ShardReader._opened`)."""
    path: str
    size: Callable[[], int | None]  # its size; None where it does not exist
    reads: Callable[[list[tuple[int, int]]], list[bytes]] | None  # None: it does not

    def spans(self, wanted: list[tuple[int, int]]) -> list[bytes]:
        """The bytes in each (start, end) of ``wanted``."""
        if self.reads is None:
            raise FileNotFoundError(self.path)
        got = self.reads(wanted)
        for (start, end), data in zip(wanted, got):
            if len(data) != end - start:
                raise OSError(f"{self.path}: ends before byte {end} (truncated)")
        return got


def _pread(fd: int, start: int, end: int, path: str) -> bytes:
    """Bytes ``start`` to ``end`` of a file; a short read (FUSE, NFS) goes on from where it
    stopped, and ends only at the end of the file."""
    parts = []
    while start < end and (data := os.pread(fd, end - start, start)):
        parts.append(data)
        start += len(data)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class _Reads:
    """:class:`Places` gathered one destination at a time (DCP's planned reads), with
    the destinations' addresses."""

    def __init__(self):
        self.files: dict[str, int] = {}
        self.rows: list[tuple[int, int, int, int]] = []

    def add(self, relative_path: str, start: int, length: int, address: int) -> None:
        self.rows.append((self.files.setdefault(relative_path, len(self.files)), start,
                          length, address))

    def places(self, root: str) -> tuple[Places, np.ndarray]:
        file, start, length, address = np.array(self.rows, np.int64).reshape(-1, 4).T
        return Places([posixpath.join(root, f) for f in self.files], file, start,
                      length), address


class ShardReader(FsspecReader):
    """DCP storage reader for the raw format (and, through DCP's own code, the stock one):
    ``dcp.load(state_dict, storage_reader=ShardReader(url))``."""

    def __init__(self, path, *, threads: int = 4, rank: int | None = None,
                 world: int | None = None, **kwargs) -> None:
        """``rank`` of ``world``: the loading rank, whose own items a restart at the
        saved world size finds in INDEX2.bin (see :meth:`own_section`).

        DCP's own state (FsspecReader's file systems, path and load id) is set up when
        DCP first asks for it (:meth:`__getattr__`): a load in place never does, and
        setting it up was a tenth of a 2-rank load's Python here."""
        self._dcp_path = path  # None once DCP's state is set up
        self.threads, self._rank, self._world, self._options = threads, rank, world, kwargs
        self._open(path)

    def _open(self, path) -> None:
        """Reads ``path`` from now on, its index and metadata read anew."""
        self._fs, self._root = fsspec.core.url_to_fs(os.fspath(path), **self._options)
        self._metadata = None
        self._items: Items | None = None
        self._own: Section | bool | None = None  # False: none

    def __getattr__(self, name: str):
        """An attribute of DCP's own state, set up on the first such miss."""
        if name.startswith("__") or not self._set_up_dcp():
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self, name)

    def _set_up_dcp(self) -> bool:
        """Sets up DCP's own state unless it is already; whether this did."""
        path = self.__dict__.get("_dcp_path")
        if path is None:
            return False
        self._dcp_path = None
        FsspecReader.__init__(self, path, **self._options)
        return True

    def reset(self, checkpoint_id=None) -> None:
        """DCP's call before each load; with ``checkpoint_id`` (``dcp.load(...,
        checkpoint_id=...)``), the reader reads that checkpoint from now on."""
        self._set_up_dcp()
        super().reset(checkpoint_id)
        if checkpoint_id:
            self._open(checkpoint_id)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        """The checkpoint's ``.metadata`` (with ``rank``, DCP's fallback: that rank's own
        ``__<rank>.metadata``), as DCP's reader reads it but unpickled by
        :class:`MetadataUnpickler`: a pickle that names anything else than what DCP's
        index is made of is refused (DamagedCheckpoint) and runs nothing. The whole
        checkpoint's is read once per reader: the caller looks at it before DCP does."""
        rank = kwargs.get("rank")
        if rank is None and self._metadata is not None:
            return self._metadata
        path = posixpath.join(self._root, ".metadata" if rank is None else f"__{rank}.metadata")
        with collector.paused(), self._fs.open(path, "rb") as f:
            try:
                metadata = MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                raise DamagedCheckpoint([f"{path}: not DCP's index ({e}): refused"]) from None
        if not isinstance(metadata, Metadata):
            raise DamagedCheckpoint([f"{path}: not DCP's index (a {type(metadata).__name__})"])
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        if rank is None:
            self._metadata = metadata
        return metadata

    def stored_items(self) -> Items:
        """Every stored item (:data:`Items`), read once per reader: from ITEMS.json, or
        from ``.metadata`` in checkpoints written before it. Either must be verified."""
        if self._items is None:
            path = posixpath.join(self._root, ITEMS)
            try:
                data = self._fs.cat_file(path)
            except FileNotFoundError:
                self._items = metadata_items(self.read_metadata())
            else:
                self._items = index.parse_rows(json.loads(data)["items"], path)
        return self._items

    def own_section(self) -> Section:
        """The items of the loading rank's own state when the checkpoint was saved at
        this world size, from its sections of INDEX2.bin (its table entry and the footer
        in one request, then its sections, each checked against its digest): O(its own
        items) whatever the world size, its tensor chunks in columns. Otherwise (another
        world size, a checkpoint written before the index, no rank given) every stored
        item, as rows."""
        if self._own is None:
            known = self._rank is not None and self._world is not None
            self._own = (known and self._section(self._rank, self._world)) or False
        return self._own or index.rows_only(self.stored_items())

    def own_items(self) -> Items:
        """:meth:`own_section`'s items, as :data:`Items`."""
        return self.own_section().items()

    def has_own_section(self) -> bool:
        """Whether :meth:`own_section` comes from this rank's sections of INDEX2.bin."""
        self.own_section()
        return bool(self._own)

    def _section(self, rank: int, world: int) -> Section | None:
        for name, magic in ((INDEX, index.MAGIC), (index.INDEX_ROWS, index.MAGIC_ROWS)):
            path = posixpath.join(self._root, name)
            with self._opened(path) as file:
                size = file.size()
                if size is not None:
                    return self._read_section(path, size, file.spans, magic, rank, world)
        return None

    def _read_section(self, path: str, size: int, spans: Callable, magic: bytes, rank: int,
                      world: int) -> Section | None:
        foot, entry = size - index.FOOT.size, index.entry_offset(size, rank, world)
        if entry < 0:  # saved at fewer ranks
            return None
        tail, raw_entry = spans([(foot, size), (entry, entry + index.ENTRY.size)])
        found_magic, saved_world = index.FOOT.unpack(tail)
        if found_magic != magic:
            raise DamagedCheckpoint([f"{path}: not an llmtrain index (magic {found_magic!r})"])
        if saved_world != world:
            return None
        fields = index.ENTRY.unpack(raw_entry)
        sections = [fields[:3], fields[3:]] if fields[4] else [fields[:3]]
        found = []
        for (offset, length, digest), data in zip(sections, spans(
                [(s[0], s[0] + s[1]) for s in sections])):
            if index.digest(data) != digest:
                raise DamagedCheckpoint([f"{path}: a section of rank {rank}'s entry differs "
                                         f"from its digest (corrupted)"])
            head, section = index.parse_section(data, path, columns=magic == index.MAGIC)
            if head["world"] != world or head.get("rank", rank) != rank:
                raise DamagedCheckpoint([f"{path}: rank {rank}'s entry points to a section of "
                                         f"rank {head.get('rank')} of {head['world']}"])
            found.append(section)
        return index.merged(found)

    @contextlib.contextmanager
    def _opened(self, path: str):
        """``path`` as an :class:`_File`: positional reads through one descriptor for a
        local file (fsspec's ``cat_ranges`` opens the file once per span: 95 us against
        11 for two spans here), else one ``cat_ranges`` request a call."""
        if not is_local(self._fs):
            def size() -> int | None:
                try:
                    return self._fs.size(path)
                except FileNotFoundError:
                    return None
            yield _File(path, size, lambda wanted: self._fs.cat_ranges(
                [path] * len(wanted), [s for s, _ in wanted], [e for _, e in wanted],
                on_error="raise"))
            return
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            yield _File(path, lambda: None, None)
            return
        try:
            yield _File(path, lambda: os.fstat(fd).st_size,
                        lambda wanted: [_pread(fd, start, end, path) for start, end in wanted])
        finally:
            os.close(fd)

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs) -> None:
        """DCP's call with the checkpoint's metadata before it plans a load; the stored
        items come from it where :meth:`stored_items` has not read them yet."""
        self._set_up_dcp()  # before DCP's fields are set, not after (it would clear them)
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        if self._items is None:
            self._items = metadata_items(metadata)

    def read_data(self, plan, planner) -> Future:
        """DCP's call to read this rank's planned items: raw items by parallel range
        reads into their destinations, ``torch.save`` records by DCP's own reader."""
        legacy = [r for r in plan.items if r.type == LoadItemType.TENSOR
                  and RAW not in (self.storage_data[r.storage_index].transform_descriptors or ())]
        if legacy:  # torch.save records: DCP's own reader
            super().read_data(dataclasses.replace(plan, items=legacy), planner).wait()
        skip = {id(r) for r in legacy}
        reads = _Reads()
        after: list = []  # (read item, destination, scratch view or None, bytes buffer)
        for req in plan.items:
            if id(req) in skip:
                continue
            info = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                buf = bytearray(info.length)
                reads.add(info.relative_path, info.offset, info.length, direct_io.address(buf))
                after.append((req, None, None, buf))
                continue
            stored = self._items[(req.storage_index.fqn, tuple(req.storage_index.offset))]
            sizes, dtype = stored.sizes, stored.dtype
            first, shape = _slab(sizes, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            direct = (target.device.type == "cpu" and target.dtype == dtype
                      and target.is_contiguous() and tuple(target.shape) == tuple(shape))
            scratch = target if direct else torch.empty(shape, dtype=dtype)
            reads.add(info.relative_path, info.offset + first * dtype.itemsize,
                      scratch.nbytes, scratch.data_ptr())
            view = None
            if not direct:  # the wanted box inside the slab
                view = scratch
                for dim in range(1, len(shape)):
                    if shape[dim] != req.lengths[dim]:
                        view = view.narrow(dim, req.storage_offsets[dim], req.lengths[dim])
            after.append((req, target, view, None))
        places, address = reads.places(self._root)
        read_scheduled(self._fs, schedule_reads(places, is_local(self._fs)), address,
                       self.threads)
        for req, target, view, buf in after:
            if buf is not None:
                planner.load_bytes(req, io.BytesIO(buf))
                continue
            if view is not None:
                target.copy_(view)
            planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut


def load_unsharded(url: str, threads: int = 4) -> dict:
    """The whole checkpoint at ``url`` as one nested state dict of full CPU tensors, in
    this process (no process group). Call only after ``storage.verify`` passed."""
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    class Planner(PlainObjectsPlanner, _EmptyStateDictLoadPlanner):
        """Fills the state from the metadata, as ``dcp_to_torch_save`` does."""

    state: dict = {}
    _load_state_dict(state, storage_reader=ShardReader(url, threads=threads),
                     planner=Planner(), no_dist=True)
    return state
