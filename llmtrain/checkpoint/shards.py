"""DCP shard files as raw tensor bytes: the save's data path and a parallel reader.

DCP's stock file format stores every tensor as a ``torch.save`` archive, so a save pays a
zip writer (with CRC32) per tensor and a load pays ``torch.load`` (an unpickling and a
fresh buffer) per tensor, then a second copy into the destination, on one thread. Here a
tensor is stored as its bare bytes (C order, native byte order); its dtype and shape are
already in DCP's ``.metadata`` (the chunk's global offsets and sizes), its place in the
file in the item's ``_StorageInfo``, which also carries the descriptor :data:`RAW`. So:

- writing is one ``write`` per 4 MiB of a tensor's memory, each piece hashed by the
  writing thread while it is still in the CPU cache, on several writer threads, one file
  each. Every item's checksum goes into its ``_StorageInfo`` (a descriptor
  ``xxh3_128=<hex>``; ``sha256=`` in checkpoints written before, see
  :mod:`llmtrain.checkpoint.checksum`), so a reader can check exactly what it reads, and
  the manifest commits to the item sums (:mod:`llmtrain.checkpoint.storage`);
- reading is positional range reads straight into the destination tensors' memory (a
  scratch buffer and one copy only when the destination's layout or dtype differ, as in
  some reshardings), given as arrays of places and addresses (no Python object per
  range) and cut into pieces that several threads read ahead in parallel, one
  ``preadv`` per run of back-to-back pieces; object stores get the ranges in batches
  (``cat_ranges``). A restart at the world size of the save skips DCP's planning too
  (:func:`plan_in_place`, :func:`read_objects`, :func:`read_in_place`): each live
  shard is matched to its saved chunk among the rank's own items (its sections of
  INDEX2.bin, see :mod:`llmtrain.checkpoint.index`; else ITEMS.json, the places
  ``.metadata`` lists, as plain data: nothing is unpickled) and read into at that
  place, and checked against its sum once read, so a resume reads its data once, not
  once to verify it and again to load it.

Everything else is DCP's: planners, resharding, ``.metadata``, non-tensor items (bytes,
written as they are); but where DCP unpickles ``.metadata`` and the non-tensor items as
they are, which runs whatever a pickle names, llmtrain reads them through unpicklers of
DCP's index and of plain values (:meth:`ShardReader.read_metadata`,
:class:`PlainObjectsPlanner`). Items without the descriptor (checkpoints written before this
format) are read by DCP's stock reader, so old checkpoints load. Stock
``FileSystemReader``/``FsspecReader`` refuse the new files (unknown extension
``llmtrain-raw``) rather than misread them: pass a :class:`ShardReader` to
``torch.distributed.checkpoint.load``, and :func:`load_unsharded` for what DCP's
``format_utils.dcp_to_torch_save`` does.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import dataclasses
import errno
import functools
import io
import json
import math
import os
import pickle
import posixpath
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple

import fsspec
import numpy as np
import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import (DEFAULT_SUFFIX, _split_by_size_and_type,
                                                     _StorageInfo)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from llmtrain import collector
from llmtrain.checkpoint import checksum, direct_io, index
from llmtrain.checkpoint.index import (INDEX, ITEMS, RAW, Items, Section, StoredItem,
                                       metadata_items)
from llmtrain.checkpoint.staging import host_block, lower_priority
from llmtrain.fsio import is_local

READ_PIECE = 16 << 20   # the unit several threads share a large tensor's reading in
BATCH = 64 << 20        # bytes of ranges per cat_ranges call (object stores)
OBJECTS_GAP = 1 << 20   # bytes between two objects of a file that one read of both spans
_IOV_MAX = 1024         # buffers one preadv may fill (Linux's IOV_MAX)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's elements as bytes, C order (a view when it is on CPU and contiguous),
    as a save writes them; the common case (a plain CPU tensor, contiguous, of a dtype
    numpy knows) takes numpy's view directly, at half the general path's cost."""
    if type(tensor) is torch.Tensor:  # a subclass converts in its own way
        try:
            return memoryview(tensor.numpy()).cast("B")
        except (TypeError, RuntimeError):  # not on CPU or contiguous, bf16, needs grad
            pass
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")


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


def write_shards(fs, root, plan, planner, thread_count: int, raw: bool = True,
                 nice: int = 0) -> Future:
    """Writes this rank's items of ``plan`` to ``thread_count`` files on as many threads.
    ``fs`` is DCP's FileSystem whose streams fsync as the storage needs and have
    ``write_item(view) -> its checksum, labelled``
    (:class:`llmtrain.checkpoint.storage.CommitWriter`). ``raw`` False writes DCP's own
    items instead (a tensor as ``torch.save`` of it, no descriptors), which stock DCP
    readers load; each file's sha256 is then in the manifest only. ``nice``: added to
    each writer thread's niceness (:func:`.staging.lower_priority`)."""
    buckets = [b for b in _split_by_size_and_type(thread_count, plan.items) if b]
    names = [f"{plan.storage_data.prefix}{i}{DEFAULT_SUFFIX}" for i in range(len(buckets))]

    def write(name: str, items) -> list[WriteResult]:
        results, offset = [], 0
        with fs.create_stream(fs.concat_path(root, name), "wb") as stream:
            for item in sorted(items, key=_file_order):
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    view, descriptors = data.getbuffer(), []
                elif raw:
                    view, descriptors = tensor_bytes(data), [RAW]
                else:
                    view, descriptors = stock_item(data), []
                if raw:  # each item hashed on its own, its sum kept beside it
                    descriptors.append(stream.write_item(view))
                else:  # the file hashed whole: stock readers refuse unknown descriptors
                    stream.write(view)
                results.append(WriteResult(index=item.index, size_in_bytes=len(view),
                                           storage_data=_StorageInfo(name, offset, len(view),
                                                                     descriptors or None)))
                offset += len(view)
        return results

    # once per thread, not per file: a thread that finishes a file early takes the next
    # one and must not lower itself again; the pool's threads end with this save
    with ThreadPoolExecutor(max_workers=max(1, len(buckets)), initializer=lower_priority,
                            initargs=(nice,)) as pool:
        done = list(pool.map(write, names, buckets))
    fut: Future = Future()
    fut.set_result([r for results in done for r in results])
    return fut


def _file_order(item) -> tuple[bool, bool]:
    """Where an item goes in its file. Tensors first: their places then stay from one
    save to the next while the objects' sizes change (a load keeps its layout for as long,
    plan_in_place). Of those, the ones of whole pages first: each then starts a page of
    the file as it starts one of the staging buffers, which a direct write takes as it
    lies, with no copy, up to the first tensor of another size (direct_io)."""
    if item.type == WriteItemType.BYTE_IO:
        return True, True
    data = item.tensor_data
    nbytes = math.prod(data.chunk.sizes) * data.properties.dtype.itemsize
    return False, nbytes % direct_io.ALIGN != 0


def stock_item(tensor: torch.Tensor) -> memoryview:
    """A tensor as DCP's stock writer stores it: ``torch.save`` of a CPU copy that owns
    exactly its elements (a view would drag its whole storage along)."""
    t = tensor.detach().cpu()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        t = t.clone(memory_format=torch.contiguous_format)
    buffer = io.BytesIO()
    torch.save(t, buffer)
    return buffer.getbuffer()


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


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _readers(threads: int) -> ThreadPoolExecutor:
    """A pool of ``threads`` reading threads, kept for the process: a load does not wait
    for threads to start (about a millisecond a pool)."""
    threads = max(1, threads)
    with _pools_lock:
        if threads not in _pools:
            _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="llmtrain-read")
        return _pools[threads]


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
        :class:`_MetadataUnpickler`: a pickle that names anything else than what DCP's
        index is made of is refused (DamagedCheckpoint) and runs nothing. The whole
        checkpoint's is read once per reader: the caller looks at it before DCP does."""
        rank = kwargs.get("rank")
        if rank is None and self._metadata is not None:
            return self._metadata
        path = posixpath.join(self._root, ".metadata" if rank is None else f"__{rank}.metadata")
        with collector.paused(), self._fs.open(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
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
        self._set_up_dcp()  # before DCP's fields are set, not after (it would clear them)
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        if self._items is None:
            self._items = metadata_items(metadata)

    def read_data(self, plan, planner) -> Future:
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
        _read(self._fs, _schedule(places, is_local(self._fs)), address, self.threads)
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


def _own_cpus() -> int:
    """The CPUs this process may run on, shared among its node's ranks (at least one)."""
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    return max(1, len(os.sched_getaffinity(0)) // ranks)


class Places(NamedTuple):
    """Byte ranges of files to read, one row per destination: the file ``paths[file]``,
    from ``start``, ``length`` bytes. Arrays, not an object per range: a load of a few
    hundred tensors spends no Python on each one."""
    paths: list[str]
    file: np.ndarray    # int64
    start: np.ndarray   # int64
    length: np.ndarray  # int64


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


_libc = ctypes.CDLL(None, use_errno=True)
_libc.preadv.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong)
_libc.preadv.restype = ctypes.c_ssize_t


def _preadv(fd: int, iov: int, count: int, at: int) -> int:
    """``preadv(2)`` into the ``count`` buffers of the iovec array at address ``iov``
    (rows of address and length, uint64) from byte ``at``: the bytes read. Called
    through ctypes, which lets go of the GIL, on an array: ``os.preadv`` wants a Python
    buffer object for each range."""
    while (n := _libc.preadv(fd, iov, count, at)) < 0:
        error = ctypes.get_errno()
        if error != errno.EINTR:  # a signal: again, as os.preadv does
            raise OSError(error, os.strerror(error))
    return n


def _fill(fd: int, iov: np.ndarray, address: int, at: int, want: int, path: str) -> None:
    """Reads ``want`` bytes into the buffers of ``iov`` (whose rows start at ``address``)
    from ``at``; a short read goes on from where it stopped (a FUSE or NFS file may
    return fewer bytes than asked), the end of file raises."""
    while True:
        n = _preadv(fd, address, len(iov), at)
        if n == want:
            return
        if n == 0:
            raise OSError(f"{path}: ends at {at}, {want} bytes short (truncated)")
        at, want = at + n, want - n
        filled = np.cumsum(iov[:, 1])
        whole = int(np.searchsorted(filled, n, side="right"))
        iov = iov[whole:].copy()
        n -= int(filled[whole - 1]) if whole else 0
        iov[0, 0] += n
        iov[0, 1] -= n
        address = iov.ctypes.data


class _Schedule(NamedTuple):
    """How :class:`Places` are read (see :func:`_read`): rows cut into pieces of up to
    READ_PIECE bytes, in file order, and the bounds of the runs of pieces one read
    fills. It depends on the places alone, so a load of the same layout keeps it."""
    paths: list[str]
    row: np.ndarray    # each piece's row
    skip: np.ndarray   # the bytes of its row before it
    size: np.ndarray   # its bytes
    file: list[int]
    start: list[int]
    whole: np.ndarray  # its row where it is the whole row, else -1
    split: list[int]   # rows of several pieces
    runs: list[int]    # where each run starts, and the end
    local: bool


def _schedule(places: Places, local: bool) -> _Schedule:
    """Pieces and runs of ``places``: with ``local`` (files read by ``preadv``), a run is
    back-to-back pieces of one file, up to _IOV_MAX of them and cut where their bytes
    cross a multiple of READ_PIECE (so at most twice that); otherwise (an object store's
    batches of ranges), any pieces, cut where their bytes cross a multiple of BATCH."""
    rows = np.flatnonzero(places.length > 0)
    pieces = np.maximum(1, -(-places.length[rows] // READ_PIECE))
    row = np.repeat(rows, pieces)
    skip = (np.arange(len(row)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * READ_PIECE
    file, start = places.file[row], places.start[row] + skip
    order = np.lexsort((start, file))
    row, skip, file, start = row[order], skip[order], file[order], start[order]
    size = np.minimum(places.length[row] - skip, READ_PIECE)
    whole = np.where(pieces[np.searchsorted(rows, row)] == 1, row, -1)
    before = np.cumsum(size) - size  # bytes before each piece
    cut = np.ones(len(row), bool)
    cut[1:] = before[1:] // (READ_PIECE if local else BATCH) != before[:-1] // (
        READ_PIECE if local else BATCH)
    if local and len(row):
        cut[1:] |= (file[1:] != file[:-1]) | (start[1:] != start[:-1] + size[:-1])
        first = np.flatnonzero(cut)
        position = np.arange(len(row)) - np.repeat(first, np.diff(np.append(first, len(row))))
        cut[1:] |= position[1:] % _IOV_MAX == 0
    return _Schedule(places.paths, row, skip, size, file.tolist(), start.tolist(), whole,
                     rows[pieces > 1].tolist(), [*np.flatnonzero(cut).tolist(), len(row)],
                     local)


def _read(fs, schedule: _Schedule, address: np.ndarray, threads: int,
          done: list | None = None) -> None:
    """Fills every row of a schedule, whose memory starts at ``address[row]`` (memory the
    caller holds until this returns), ``threads`` reads at a time; ``done[row]``, where
    given, runs once that row is full. A local file's runs are read by one ``preadv``
    each, so a state of many small tensors costs a few dozen calls, not one call and one
    task handed to a thread per tensor. Each thread reads one stretch of the files in
    order, through descriptors of its own, so the kernel sees sequential reads and reads
    ahead: 16 MiB pieces dealt out in turn to 4 threads sharing one descriptor per file
    read a cold 286 MB checkpoint in 145-187 ms here, against 93 ms for one thread.
    Local reads take at most as many threads as this rank has CPUs of its own: from the
    page cache a read is a copy, and with 4 threads for each of 2 ranks on 2 cores a
    warm 286 MB load took 9.3 ms longer than a raw read of its files, against 5.7 ms
    with one thread each. One stretch is read by the calling thread (no hand-off to a
    reader and back). Other storage gets one ``cat_ranges`` request a run."""
    runs = schedule.runs
    if len(runs) < 2:
        return
    iov = np.empty((len(schedule.row), 2), np.uint64)
    iov[:, 0] = address[schedule.row] + schedule.skip
    iov[:, 1] = schedule.size
    job = _Job(fs, schedule, iov, done)
    threads = min(threads, len(runs) - 1)
    if schedule.local:
        threads = min(threads, _own_cpus())
    if schedule.local and threads <= 1:
        job.read(runs)
    else:
        stretches = (_stretches(runs, schedule.size, threads) if schedule.local
                     else [runs[i:i + 2] for i in range(len(runs) - 1)])
        for _ in _readers(threads).map(job.read if schedule.local else job.fetch,
                                       stretches):
            pass
    if done is not None:  # rows of several pieces, once all of them are in
        split = [r for r in schedule.split if done[r] is not None]
        for _ in _readers(threads).map(lambda r: done[r](), split):
            pass


def _stretches(runs: list[int], size: np.ndarray, count: int) -> list[list[int]]:
    """``runs`` (bounds, in file order) cut into up to ``count`` consecutive stretches
    of about equal bytes, each as its own bounds."""
    before = np.concatenate([[0], np.cumsum(size)])[runs]  # bytes before each bound
    cuts = np.searchsorted(before, before[-1] * np.arange(1, count) / count)
    bounds = sorted({0, *cuts.tolist(), len(runs) - 1})
    return [runs[a:b + 1] for a, b in zip(bounds, bounds[1:])]


class _Job(NamedTuple):
    """One :func:`_read`: how each thread reads its share of the runs (their bounds)."""
    fs: object
    schedule: _Schedule
    iov: np.ndarray
    done: list | None

    def read(self, runs: list[int]) -> None:
        """Local files: one ``preadv`` a run, in order, through descriptors of this
        thread's own."""
        s, fds = self.schedule, {}
        base = self.iov.ctypes.data  # each run's rows: 16 bytes a row on from here
        try:
            for a, b in zip(runs, runs[1:]):
                f = s.file[a]
                if f not in fds:
                    fds[f] = os.open(s.paths[f], os.O_RDONLY)
                want = s.start[b - 1] + int(s.size[b - 1]) - s.start[a]
                _fill(fds[f], self.iov[a:b], base + 16 * a, s.start[a], want, s.paths[f])
                self._done(a, b)
        finally:
            for fd in fds.values():
                os.close(fd)

    def fetch(self, runs: list[int]) -> None:
        """Other storage: one ``cat_ranges`` request a run."""
        s = self.schedule
        for a, b in zip(runs, runs[1:]):
            paths = [s.paths[f] for f in s.file[a:b]]
            sizes = s.size[a:b].tolist()
            got = self.fs.cat_ranges(paths, s.start[a:b],
                                     [at + n for at, n in zip(s.start[a:b], sizes)])
            for i, data in enumerate(got):
                if isinstance(data, Exception):
                    raise data
                if len(data) != sizes[i]:
                    raise OSError(f"{paths[i]}: {len(data)} bytes at {s.start[a + i]}, "
                                  f"expected {sizes[i]} (truncated)")
                ctypes.memmove(int(self.iov[a + i, 0]), data, len(data))
            self._done(a, b)

    def _done(self, a: int, b: int) -> None:
        if self.done is not None:
            for r in self.schedule.whole[a:b].tolist():
                if r >= 0 and self.done[r] is not None:
                    self.done[r]()


class LiveShards:
    """A rank's live tensors as a load finds them: {(FQN, global offset of its shard)}
    keys, the tensors, each one's key line (:func:`index.key_line`), and the last
    in-place layout found for them (see :func:`plan_in_place`). A caller loading into
    the same tensors again keeps it."""

    def __init__(self, tensors: dict):
        self.keys = list(tensors)
        self.tensors = list(tensors.values())
        self.lines = [index.key_line(fqn, offset, t.shape, t.dtype)
                      for (fqn, offset), t in tensors.items()]
        self.kept: tuple[tuple, _Layout] | None = None


class _Layout(NamedTuple):
    """Where an in-place load reads each live tensor from, and how: what a load keeps
    while the checkpoint's layout stays the same."""
    targets: list[torch.Tensor]  # the live tensors, in the order of the rows of places
    files: list[str]             # the files of places, relative to the checkpoint's root
    places: Places
    schedule: _Schedule
    chosen: list[int]            # the section's column of each of the first rows
    keys: list[tuple]            # the item among the rows of each row after those
    on_cpu: bool                 # every target a plain CPU tensor (then if contiguous,
                                 # read into directly)


class InPlace(NamedTuple):
    """A load with no planning (:func:`plan_in_place`): where each live tensor and each
    object is, and their recorded sums, in the checkpoint read."""
    layout: _Layout
    section: Section
    objects: list[tuple[str, StoredItem]]

    @property
    def checked(self) -> bool:
        """Every item has a recorded sum (the columns always do)."""
        return all(item_sum(item) for item in
                   [*map(self.section.rows.__getitem__, self.layout.keys),
                    *(item for _, item in self.objects)])

    def sum(self, row: int) -> tuple[str, str] | None:
        """(algorithm, hex digest) recorded for a tensor's row."""
        chosen = self.layout.chosen
        if row < len(chosen):
            j = chosen[row]
            return index.SUMMED, self.section.digests[16 * j:16 * j + 16].hex()
        return item_sum(self.section.rows[self.layout.keys[row - len(chosen)]])

    def name(self, row: int) -> str:
        chosen = self.layout.chosen
        if row < len(chosen):
            return self.section.lines[chosen[row]].split("\t")[0]
        return self.layout.keys[row - len(chosen)][0]


def plan_in_place(reader: ShardReader, live: LiveShards, objects: list[str]) -> InPlace | None:
    """Where each live tensor's saved chunk is (one at its offset with its shape and
    dtype, in the raw format) and where the objects named are, among the reader's own
    items; None when some live tensor has none, or, in a section of INDEX2.bin, some saved
    chunk has no live tensor (a resharding load, a checkpoint written before the raw
    format): then DCP's planner is the way.

    A section's tensor chunks are matched as lines: one dict of the saved lines, one
    lookup per live line, and arrays indexed by the result; no object is made per
    tensor. Items kept as rows (an index written before columns, ITEMS.json,
    ``.metadata``) are looked up one by one. The tensors' layout is kept with ``live``,
    and a checkpoint whose section has the same one (a later checkpoint of the run: a
    file holds its tensors before its objects, whose sizes change, see
    :func:`write_shards`) takes it as it is, its lines, files and places compared byte
    for byte, not matched again."""
    section = reader.own_section()
    found = [section.rows.get((name, None)) for name in objects]
    if None in found:
        return None
    key = (section.layout, is_local(reader._fs))
    if live.kept is not None and section.layout and live.kept[0] == key:
        layout = _rooted(live.kept[1], reader._root)
    else:
        layout = _layout(reader, section, live)
        if layout is None:
            return None
        live.kept = (key, layout) if not layout.keys else None
    return InPlace(layout, section, list(zip(objects, found)))


def _layout(reader: ShardReader, section: Section, live: LiveShards) -> _Layout | None:
    rows = section.rows
    saved = dict(zip(section.lines, range(len(section.lines))))
    chosen = list(map(saved.get, live.lines))
    targets, keys = live.tensors, []
    if None in chosen:  # looked up among the rows
        targets = [t for t, j in zip(live.tensors, chosen) if j is not None]
        for key, t, j in zip(live.keys, live.tensors, chosen):
            if j is not None:
                continue
            item = rows.get(key)
            if (item is None or RAW not in item.transform_descriptors
                    or item.sizes != t.shape or item.dtype != t.dtype):
                return None
            keys.append(key)
            targets.append(t)
        chosen = [j for j in chosen if j is not None]
    if len(chosen) != len(section.lines):  # a saved chunk no live tensor takes
        return None
    extra = [rows[key] for key in keys]
    files = dict(zip(section.files, range(len(section.files))))
    for item in extra:
        files.setdefault(item.relative_path, len(files))
    columns = np.array(chosen, np.int64)

    def column(saved: np.ndarray, more: list[int]) -> np.ndarray:
        return np.concatenate([saved[columns].astype(np.int64), np.array(more, np.int64)])

    places = Places([posixpath.join(reader._root, f) for f in files],
                    column(section.file, [files[item.relative_path] for item in extra]),
                    column(section.start, [item.offset for item in extra]),
                    column(section.length, [item.length for item in extra]))
    return _Layout(targets, list(files), places, _schedule(places, is_local(reader._fs)),
                   chosen, keys, all(t.is_cpu and type(t) is torch.Tensor for t in targets))


def _rooted(layout: _Layout, root: str) -> _Layout:
    """A kept layout with its files in the checkpoint at ``root``."""
    paths = [posixpath.join(root, f) for f in layout.files]
    return layout._replace(places=layout.places._replace(paths=paths),
                           schedule=layout.schedule._replace(paths=paths))


def read_objects(reader: ShardReader, plan: InPlace, *, check: bool = False) -> dict[str, bytes]:
    """The stored bytes of ``plan``'s objects, {name: bytes}, a file at a time: the
    objects of a file lie together (after its tensors, see :func:`write_shards`), so each
    file's are one positional read or request, or a few where they lie far apart. A few
    dozen small items: the arrays and threads of :func:`_read` took 0.7 ms of a 2-rank
    load's Python here, this 0.3. ``check``: each is compared with its recorded sum, and
    a difference raises DamagedCheckpoint."""
    by_file: dict[str, list[tuple[str, StoredItem]]] = {}
    for name, item in sorted(plan.objects, key=lambda found: found[1].offset):
        by_file.setdefault(item.relative_path, []).append((name, item))
    got, problems = {}, []
    for relative, found in by_file.items():
        spans: list[list[int]] = []  # [start, end] of each read
        for _, item in found:
            if spans and item.offset - spans[-1][1] <= OBJECTS_GAP:
                spans[-1][1] = max(spans[-1][1], item.offset + item.length)
            else:
                spans.append([item.offset, item.offset + item.length])
        with reader._opened(posixpath.join(reader._root, relative)) as file:
            data = file.spans(spans)
        starts = [a for a, _ in spans]
        for name, item in found:
            k = bisect.bisect_right(starts, item.offset) - 1
            at = item.offset - starts[k]
            got[name] = data[k][at:at + item.length]
            if check:
                _check_object(file.path, name, item, got[name], problems)
    if problems:
        raise DamagedCheckpoint(sorted(problems))
    return got


def _check_object(path: str, name: str, item: StoredItem, data: bytes,
                  problems: list[str]) -> None:
    """Adds a problem naming the object when its bytes differ from its recorded sum."""
    expected = item_sum(item)
    if expected is None:
        raise ValueError(f"{path}: {name} has no recorded sum to check")
    algorithm, digest = expected
    if checksum.of(data, algorithm) != digest:
        problems.append(f"{path}: {algorithm} differs from the manifest in {name} "
                        f"(bytes {item.offset}-{item.offset + item.length}; corrupted)")


def read_in_place(reader: ShardReader, plan: InPlace, *, check: bool = False) -> None:
    """Reads every live tensor of ``plan`` from its saved chunk straight into its memory:
    parallel range reads without DCP's planning (about 0.2 ms of Python per item, most
    of a warm load's time).

    ``check``: every tensor read is hashed (on the reading threads, while it is in the
    cache) and compared with its recorded sum before this returns; a difference raises
    DamagedCheckpoint, with the destination tensors already overwritten."""
    layout = plan.layout
    targets = layout.targets
    # each tensor's metadata is touched once (after a large read it is out of the
    # caches: at 2 ranks here each pass over 300 tensors took 0.1-0.3 ms)
    pointers = ([t.data_ptr() if t.is_contiguous() else -1 for t in targets] if layout.on_cpu
                else [-1] * len(targets))
    # destinations read through a scratch copy: views into one host block, pinned where
    # it lies for a GPU (from torch's pinned allocator, each would be rounded up to a
    # power of two and stay cached for the rest of the run)
    through = ([t for t, at in zip(targets, pointers) if at == -1 and _needs_scratch(t)]
               if -1 in pointers else [])
    gpu = any(t.device.type == "cuda" for t in through)
    scratch = dict(zip(map(id, through), host_block(through, pin=gpu)[1])) if through else {}
    address = np.array(pointers if not through else [
        scratch[id(t)].data_ptr() if id(t) in scratch else t.data_ptr() for t in targets],
        np.int64)
    problems: list[str] = []
    _read(reader._fs, layout.schedule, address, reader.threads,
          _checks(layout.places, address, plan.sum, plan.name, problems) if check else None)
    if problems:
        raise DamagedCheckpoint(sorted(problems))
    for target in through:
        target.copy_(scratch[id(target)], non_blocking=True)
    if gpu:
        torch.cuda.current_stream().synchronize()  # before the pinned scratch goes


def _checks(places: Places, address: np.ndarray, sum_of: Callable, name_of: Callable,
            problems: list[str]) -> list:
    """For each row of ``places``, read to ``address[row]``: a check of its bytes
    against ``sum_of(row)`` (algorithm, hex digest), which adds a problem naming
    ``name_of(row)`` when they differ."""
    return [functools.partial(_damaged, places, row, address, sum_of, name_of, problems)
            for row in range(len(address))]


def _needs_scratch(target: torch.Tensor) -> bool:
    """A destination that cannot be read into directly: on a GPU, not contiguous, or a
    tensor subclass (its own ``copy_`` does the conversion)."""
    return not (target.is_cpu and target.is_contiguous() and type(target) is torch.Tensor)


def _damaged(places: Places, row: int, address: np.ndarray, sum_of: Callable,
             name_of: Callable, problems: list[str]) -> None:
    """Hashes one row's bytes as read (hashing lets go of the GIL, so reading threads
    check in parallel) and adds a problem naming its item when its sum differs."""
    start, length = int(places.start[row]), int(places.length[row])
    path = places.paths[places.file[row]]
    expected = sum_of(row)
    if expected is None:
        raise ValueError(f"{path}: {name_of(row)} has no recorded sum to check")
    algorithm, digest = expected
    data = (ctypes.c_char * length).from_address(int(address[row]))
    if checksum.of(data, algorithm) != digest:
        problems.append(f"{path}: {algorithm} differs from the manifest in {name_of(row)} "
                        f"(bytes {start}-{start + length}; corrupted)")


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


class _MetadataUnpickler(_PlainUnpickler):
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
