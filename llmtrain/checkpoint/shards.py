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
  some reshardings), split into pieces that several threads read ahead in parallel;
  object stores get the ranges in batches (``cat_ranges``). A restart at the world size
  of the save skips DCP's planning too (:func:`read_in_place`): each saved chunk is
  looked up by name and offset among the rank's own items (its sections of
  :data:`INDEX`, see :func:`write_index`; else :data:`ITEMS`, the places ``.metadata``
  lists, as plain data: nothing is unpickled) and read into the live shard at that
  place, and checked against its sum once read, so a resume reads its data once, not
  once to verify it and again to load it.

Everything else is DCP's: planners, resharding, ``.metadata``, non-tensor items (bytes,
written as they are). Items without the descriptor (checkpoints written before this
format) are read by DCP's stock reader, so old checkpoints load. Stock
``FileSystemReader``/``FsspecReader`` refuse the new files (unknown extension
``llmtrain-raw``) rather than misread them: pass a :class:`ShardReader` to
``torch.distributed.checkpoint.load``, and :func:`load_unsharded` for what DCP's
``format_utils.dcp_to_torch_save`` does.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import gc
import io
import json
import math
import operator
import os
import pickle
import posixpath
import struct
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple

import fsspec
import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.filesystem import (DEFAULT_SUFFIX, _split_by_size_and_type,
                                                     _StorageInfo)
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from llmtrain.checkpoint import checksum
from llmtrain.checkpoint.staging import host_block
from llmtrain.fsio import is_local

RAW = "llmtrain-raw/1"  # the transform descriptor of an item stored as bare tensor bytes
READ_PIECE = 16 << 20   # the unit several threads share a large tensor's reading in
BATCH = 64 << 20        # bytes of ranges per cat_ranges call (object stores)
_IOV_MAX = 1024         # buffers one preadv may fill (Linux's IOV_MAX)
ITEMS = "ITEMS.json"    # every stored item's place, as plain data (beside DCP's .metadata)
INDEX = "INDEX.bin"     # each rank's own items, found in O(its items) (see write_index)
_SECTION = struct.Struct("<QQ16s")             # offset, length, xxh3_128 digest
_INDEX_ENTRY = struct.Struct("<QQ16sQQ16s")    # a rank's shared section, then its own
_INDEX_FOOT = struct.Struct("<8sQ")            # magic, world size of the save
_INDEX_MAGIC = b"LLMIDX01"


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's elements as bytes, C order (a view when it is on CPU and contiguous).
    A load makes one per tensor, so the common case (a plain CPU tensor, contiguous, of a
    dtype numpy knows) takes numpy's view directly, at half the general path's cost."""
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


class StoredItem(NamedTuple):
    """Where one stored item's bytes are (the fields of DCP's ``_StorageInfo``) and, for a
    chunk of a tensor, its shape and dtype; None for bytes."""
    relative_path: str
    offset: int
    length: int
    transform_descriptors: list[str]
    sizes: tuple[int, ...] | None
    dtype: torch.dtype | None


Items = dict[tuple[str, "tuple[int, ...] | None"], StoredItem]  # (FQN, chunk offset): item


def metadata_items(metadata) -> Items:
    """Every stored item of DCP's ``metadata``, keyed by its FQN and, for a chunk of a
    tensor, the chunk's global offset."""
    chunks = {(fqn, tuple(c.offsets)): (tuple(c.sizes), md.properties.dtype)
              for fqn, md in metadata.state_dict_metadata.items()
              if isinstance(md, TensorStorageMetadata) for c in md.chunks}
    items = {}
    for index, info in metadata.storage_data.items():
        offset = None if index.offset is None else tuple(index.offset)
        sizes, dtype = chunks.get((index.fqn, offset), (None, None))
        items[(index.fqn, offset)] = StoredItem(info.relative_path, info.offset, info.length,
                                                list(info.transform_descriptors or ()),
                                                sizes, dtype)
    return items


def _rows(items: Items) -> list:
    return [[fqn, offset, *item._replace(dtype=None if item.dtype is None else
                                         str(item.dtype).removeprefix("torch."))]
            for (fqn, offset), item in items.items()]


def items_json(items: Items) -> bytes:
    """ITEMS.json: what ``.metadata`` says of each stored item, as JSON rows, so a restart
    at the saved world size finds its items without unpickling ``.metadata`` (1.3-2.3 ms
    for 600 items here, against 0.4 ms to parse this; and nothing to unpickle at all)."""
    return json.dumps({"format": 1, "items": _rows(items)}, separators=(",", ":")).encode()


class IndexLayout(NamedTuple):
    """Which items go in which section of INDEX.bin (see :func:`write_index`)."""
    shared: list[list[tuple]]             # each distinct set of items several ranks hold
    ranks: list[tuple[int, list[tuple]]]  # each rank's: its set in ``shared``, its own items


def index_layout(needs: list[list[tuple]]) -> IndexLayout:
    """The sections of INDEX.bin for ranks holding ``needs[rank]`` (keys of :data:`Items`,
    from each rank's own save plan, before DCP gave each replicated item to one writer).
    O(world x items): the save planner keeps it while the plans stay."""
    holders = Counter(key for keys in needs for key in keys)
    ids: dict[frozenset, int] = {}
    shared: list[list[tuple]] = []
    ranks = []
    for keys in needs:
        mine = [key for key in keys if holders[key] > 1]
        group = ids.setdefault(frozenset(mine), len(shared))
        if group == len(shared):
            shared.append(mine)
        ranks.append((group, [key for key in keys if holders[key] == 1]))
    return IndexLayout(shared, ranks)


def write_index(stream, items: Items, layout: IndexLayout) -> None:
    """INDEX.bin, written to ``stream``: for each rank of the save, the stored items of the
    state it held, so that a restart at the saved world size reads a 64-byte table entry
    and its sections: O(its own items), where ITEMS.json and ``.metadata`` list every
    rank's (O(world) bytes for each rank, O(world^2) in all).

    Each rank's items are in two sections (``layout``): those other ranks hold too
    (replicated items, an HSDP replica's shards), in a section written once for all the
    ranks holding the same ones, and its own alone; so the file grows with the distinct
    items, as ITEMS.json does, not with world x items, and so does the time to write it.
    Layout: the sections (JSON: the world size, the rank for its own, rows as in
    ITEMS.json), written as they are made; one entry per rank (offset, length and
    XXH3-128 digest of each of its two sections); a footer (magic, world size) that a
    reader finds from the file's end."""
    world, offset = len(layout.ranks), 0

    def put(body: dict, keys: list[tuple]) -> bytes:
        nonlocal offset
        body["items"] = _rows({key: items[key] for key in keys if key in items})
        data = json.dumps(body, separators=(",", ":")).encode()
        stream.write(data)
        offset += len(data)
        return _SECTION.pack(offset - len(data), len(data), _digest(data))

    shared = [put({"world": world}, keys) for keys in layout.shared]
    table = [shared[group] + (put({"rank": rank, "world": world}, own) if own
                              else _SECTION.pack(0, 0, bytes(16)))
             for rank, (group, own) in enumerate(layout.ranks)]
    stream.write(b"".join(table))
    stream.write(_INDEX_FOOT.pack(_INDEX_MAGIC, world))


def index_entry_offset(size: int, rank: int, world: int) -> int:
    """Where ``rank``'s table entry starts in an INDEX.bin of ``size`` bytes saved at
    ``world`` ranks (negative: the file holds fewer entries)."""
    return size - _INDEX_FOOT.size - _INDEX_ENTRY.size * (world - rank)


def index_entry(data: bytes, rank: int, world: int) -> tuple:
    """``rank``'s table entry of a whole INDEX.bin: (shared section's offset, length,
    digest, own section's offset, length, digest)."""
    return _INDEX_ENTRY.unpack_from(data, index_entry_offset(len(data), rank, world))


def _digest(data: bytes) -> bytes:
    hasher = checksum.new()
    hasher.update(data)
    return hasher.digest()


_DTYPES: dict[str, torch.dtype] = {}  # dtype names met in indexes, resolved once


def _parse_items(rows: list, where: str) -> Items:
    """:data:`Items` from rows of ITEMS.json or an INDEX.bin section. A plain loop making
    each StoredItem as a tuple: 0.14 ms for 330 rows here, against 0.24 ms for a
    comprehension calling a dtype lookup and the named tuple's constructor (a resharding
    restart parses every rank's rows)."""
    items: Items = {}
    new = tuple.__new__
    for fqn, offset, path, start, length, descriptors, sizes, name in rows:
        dtype = None
        if name is not None:
            dtype = _DTYPES.get(name)
            if dtype is None:
                dtype = getattr(torch, name, None)
                if not isinstance(dtype, torch.dtype):
                    raise ValueError(f"{where}: {name!r} is not a torch dtype")
                _DTYPES[name] = dtype
        items[(fqn, None if offset is None else tuple(offset))] = new(
            StoredItem, (path, start, length, descriptors,
                         None if sizes is None else tuple(sizes), dtype))
    return items


class DamagedCheckpoint(Exception):
    """Items read back whose bytes differ from their recorded sums: a verified verdict on
    the checkpoint (not a read error), one problem per item."""

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
    each writer thread's niceness (:func:`lower_priority`)."""
    buckets = [b for b in _split_by_size_and_type(thread_count, plan.items) if b]
    names = [f"{plan.storage_data.prefix}{i}{DEFAULT_SUFFIX}" for i in range(len(buckets))]

    def write(name: str, items) -> list[WriteResult]:
        lower_priority(nice)  # the pool's threads end with this save
        results, offset = [], 0
        with fs.create_stream(fs.concat_path(root, name), "wb") as stream:
            for item in items:
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

    with ThreadPoolExecutor(max_workers=max(1, len(buckets))) as pool:
        done = list(pool.map(write, names, buckets))
    fut: Future = Future()
    fut.set_result([r for results in done for r in results])
    return fut


def lower_priority(nice: int) -> None:
    """Adds ``nice`` to the calling thread's niceness. On Linux each thread is a task with
    its own nice value, so a writer thread gets less CPU than the training threads only
    while they compete for it (at 10: about a tenth of a busy core's share), and all of
    an idle one. Elsewhere, or where refused, the thread keeps its priority."""
    if nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid)
                                                 + nice))
    except (AttributeError, OSError):
        pass


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


@dataclasses.dataclass(slots=True)
class _Range:
    path: str
    start: int
    dest: memoryview
    done: Callable[[], None] | None = None  # run by the reading thread once dest is full


_IN_FILE_ORDER = operator.attrgetter("path", "start")

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


@contextlib.contextmanager
def no_gc():
    """No cyclic collection inside: a load makes thousands of objects (unpickling DCP's
    metadata, planning), and a full collection landing in it, in a process that did not
    gc.freeze() what it imported, took 0.14-0.17 s, six times the load (one load in four
    of a 286 MB state at 2 ranks). A load leaves no cycles for it to find."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class ShardReader(FsspecReader):
    """DCP storage reader for the raw format (and, through DCP's own code, the stock one):
    ``dcp.load(state_dict, storage_reader=ShardReader(url))``."""

    def __init__(self, path, *, threads: int = 4, rank: int | None = None,
                 world: int | None = None, **kwargs) -> None:
        """``rank`` of ``world``: the loading rank, whose own items a restart at the
        saved world size finds in INDEX.bin (see :meth:`own_items`)."""
        super().__init__(path, **kwargs)
        self.threads, self.rank, self.world = threads, rank, world
        self._fs, self._root = fsspec.core.url_to_fs(os.fspath(path), **kwargs)
        self._metadata = None
        self._items: Items | None = None
        self._own: Items | None = None

    def read_metadata(self, *args, **kwargs):
        """The checkpoint's ``.metadata``, read (unpickled) once per reader: the caller
        looks at it before DCP does."""
        if args or kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            with no_gc():
                self._metadata = super().read_metadata()
        return self._metadata

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
                self._items = _parse_items(json.loads(data)["items"], path)
        return self._items

    def own_items(self) -> Items:
        """The items of the loading rank's own state when the checkpoint was saved at
        this world size, from its sections of INDEX.bin (its table entry and the footer
        in one request, then its sections, each checked against its digest): O(its own
        items) whatever the world size. Otherwise (another world size, a checkpoint
        written before the index, no rank given) every stored item."""
        if self._own is None:
            known = self.rank is not None and self.world is not None
            self._own = (known and self._section(self.rank, self.world)) or {}
        return self._own or self.stored_items()

    def has_own_section(self) -> bool:
        """Whether :meth:`own_items` come from this rank's sections of INDEX.bin."""
        self.own_items()
        return bool(self._own)

    def _section(self, rank: int, world: int) -> Items | None:
        path = posixpath.join(self._root, INDEX)
        try:
            size = self._fs.size(path)
        except FileNotFoundError:
            return None
        foot, entry = size - _INDEX_FOOT.size, index_entry_offset(size, rank, world)
        if entry < 0:  # saved at fewer ranks
            return None
        tail, raw_entry = self._spans(path, [(foot, size), (entry, entry + _INDEX_ENTRY.size)])
        magic, saved_world = _INDEX_FOOT.unpack(tail)
        if magic != _INDEX_MAGIC:
            raise DamagedCheckpoint([f"{path}: not an llmtrain index (magic {magic!r})"])
        if saved_world != world:
            return None
        fields = _INDEX_ENTRY.unpack(raw_entry)
        sections = [fields[:3], fields[3:]] if fields[4] else [fields[:3]]
        found: Items = {}
        for (offset, length, digest), data in zip(sections, self._spans(
                path, [(s[0], s[0] + s[1]) for s in sections])):
            if _digest(data) != digest:
                raise DamagedCheckpoint([f"{path}: a section of rank {rank}'s entry differs "
                                         f"from its digest (corrupted)"])
            body = json.loads(data)
            if body["world"] != world or body.get("rank", rank) != rank:
                raise DamagedCheckpoint([f"{path}: rank {rank}'s entry points to a section of "
                                         f"rank {body.get('rank')} of {body['world']}"])
            found.update(_parse_items(body["items"], path))
        return found

    def _spans(self, path: str, spans: list[tuple[int, int]]) -> list[bytes]:
        """The bytes of ``path`` in each (start, end) of ``spans``: positional reads of a
        local file (11 against 95 us for two spans here: fsspec's ``cat_ranges`` opens the file
        once per span), else one ``cat_ranges`` request."""
        if not is_local(self._fs):
            return self._fs.cat_ranges([path] * len(spans), [s for s, _ in spans],
                                       [e for _, e in spans], on_error="raise")
        fd = os.open(path, os.O_RDONLY)
        try:
            got = [os.pread(fd, end - start, start) for start, end in spans]
        finally:
            os.close(fd)
        for (start, end), data in zip(spans, got):
            if len(data) != end - start:
                raise OSError(f"{path}: ends before byte {end} (truncated)")
        return got

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        if self._items is None:
            self._items = metadata_items(metadata)

    def read_data(self, plan, planner) -> Future:
        legacy = [r for r in plan.items if r.type == LoadItemType.TENSOR
                  and RAW not in (self.storage_data[r.storage_index].transform_descriptors or ())]
        if legacy:  # torch.save records: DCP's own reader
            super().read_data(dataclasses.replace(plan, items=legacy), planner).wait()
        skip = {id(r) for r in legacy}
        ranges: list[_Range] = []
        after: list = []  # (read item, destination, scratch view or None, bytes buffer)
        for req in plan.items:
            if id(req) in skip:
                continue
            info = self.storage_data[req.storage_index]
            path = posixpath.join(self._root, info.relative_path)
            if req.type == LoadItemType.BYTE_IO:
                buf = bytearray(info.length)
                ranges.append(_Range(path, info.offset, memoryview(buf)))
                after.append((req, None, None, buf))
                continue
            stored = self._items[(req.storage_index.fqn, tuple(req.storage_index.offset))]
            sizes, dtype = stored.sizes, stored.dtype
            first, shape = _slab(sizes, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            direct = (target.device.type == "cpu" and target.dtype == dtype
                      and target.is_contiguous() and tuple(target.shape) == tuple(shape))
            scratch = target if direct else torch.empty(shape, dtype=dtype)
            dest = tensor_bytes(scratch)
            start = info.offset + first * dtype.itemsize
            for piece in range(0, len(dest), READ_PIECE):
                ranges.append(_Range(path, start + piece, dest[piece:piece + READ_PIECE]))
            view = None
            if not direct:  # the wanted box inside the slab
                view = scratch
                for dim in range(1, len(shape)):
                    if shape[dim] != req.lengths[dim]:
                        view = view.narrow(dim, req.storage_offsets[dim], req.lengths[dim])
            after.append((req, target, view, None))
        self._read(ranges)
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

    def _read(self, ranges: list[_Range]) -> None:
        """Fills every range's destination, ``threads`` reads at a time. A local file's
        back-to-back ranges (a shard file's items are) are read by one ``preadv`` of up
        to READ_PIECE bytes, so a state of many small tensors costs a few dozen calls,
        not one call and one task handed to a thread per tensor. Each thread reads one
        stretch of the files in order, through descriptors of its own, so the kernel
        sees sequential reads and reads ahead: 16 MiB pieces dealt out in turn to 4
        threads sharing one descriptor per file read a cold 286 MB checkpoint in
        145-187 ms here, against 93 ms for one thread. Local reads take at most as many
        threads as this rank has CPUs of its own: from the page cache a read is a copy,
        and with 4 threads for each of 2 ranks on 2 cores a warm 286 MB load took 9.3 ms
        longer than a raw read of its files, against 5.7 ms with one thread each. One
        stretch is read by the calling thread (no hand-off to a reader and back)."""
        if not ranges:
            return
        local = is_local(self._fs)
        runs = _runs(ranges, READ_PIECE if local else BATCH, _IOV_MAX if local else None)
        threads = min(self.threads, len(runs))
        if local:
            threads = min(threads, _own_cpus())
        if local and threads == 1:
            _read_stretch(runs)
            return
        pool = _readers(threads)
        if local:
            for _ in pool.map(_read_stretch, _stretches(runs, threads)):
                pass
            return
        for _ in pool.map(self._cat_ranges, runs):
            pass

    def _cat_ranges(self, batch: list[_Range]) -> None:
        got = self._fs.cat_ranges([r.path for r in batch], [r.start for r in batch],
                                  [r.start + len(r.dest) for r in batch])
        for r, data in zip(batch, got):
            if isinstance(data, Exception):
                raise data
            if len(data) != len(r.dest):
                raise OSError(f"{r.path}: {len(data)} bytes at {r.start}, expected "
                              f"{len(r.dest)} (truncated)")
            r.dest[:] = data
            if r.done is not None:
                r.done()


def _own_cpus() -> int:
    """The CPUs this process may run on, shared among its node's ranks (at least one)."""
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    return max(1, len(os.sched_getaffinity(0)) // ranks)


def _exact_chunks(reader: ShardReader, tensors: dict,
                  objects: list[str]) -> list[tuple[str, StoredItem, torch.Tensor | None]] | None:
    """(name, the stored item to read it from, the live tensor to read it into) for each
    tensor of ``tensors`` and (name, item, None) for each object named in ``objects``;
    None when a tensor has no saved chunk at its offset with its shape and dtype, in the
    raw format."""
    items = reader.own_items()
    found = []
    for key, target in tensors.items():
        item = items.get(key)
        if (item is None or RAW not in item.transform_descriptors
                or item.sizes != target.shape or item.dtype != target.dtype):
            return None
        found.append((key[0], item, target))
    return found + [(name, items[(name, None)], None) for name in objects]


def fits_in_place(reader: ShardReader, tensors: dict, objects: list[str], *,
                  checked: bool) -> bool:
    """Whether :func:`read_in_place` can read these (``checked``: and check every item)."""
    found = _exact_chunks(reader, tensors, objects)
    return found is not None and (not checked or all(item_sum(item) for _, item, _ in found))


def read_in_place(reader: ShardReader, tensors: dict, objects: list[str], *,
                  check: bool = False) -> dict | None:
    """Reads every tensor of ``tensors`` ({(FQN, global offset of the shard): tensor})
    from the saved chunk that starts at that offset and has its shape and dtype, straight
    into its memory, and the raw bytes of the non-tensor items named in ``objects``: one
    batch of parallel range reads, without DCP's planning (about 0.2 ms of Python per
    item, most of a warm load's time). Returns {name: bytes} of ``objects``; None, having
    read nothing, when a tensor has no such chunk in the raw format (a resharding load, a
    checkpoint written before it): then DCP's planner is the way.

    ``check``: every item read is hashed (on the reading threads) and compared with its
    recorded sum before anything is returned; a difference raises DamagedCheckpoint,
    with the destination tensors already overwritten."""
    found = _exact_chunks(reader, tensors, objects)
    if found is None:
        return None
    ranges: list[_Range] = []
    split: list[tuple[str, StoredItem, memoryview]] = []  # items read in several pieces
    problems: list[str] = []
    buffers: dict[str, bytearray] = {}
    paths = {name: posixpath.join(reader._root, name)
             for name in {info.relative_path for _, info, _ in found}}
    # destinations read through a scratch copy: views into one host block, pinned where
    # it lies for a GPU (from torch's pinned allocator, each would be rounded up to a
    # power of two and stay cached for the rest of the run)
    through = [t for t in tensors.values() if _needs_scratch(t)]
    gpu = any(t.device.type == "cuda" for t in through)
    scratch = dict(zip(map(id, through), host_block(through, pin=gpu)[1]))
    for name, info, target in found:
        if target is None:
            buffers[name] = buffer = bytearray(info.length)
            dest = memoryview(buffer)
        else:
            dest = _byte_view(scratch.get(id(target), target))
        path = paths[info.relative_path]
        if info.length <= READ_PIECE:  # checked by the thread that read it, while cached
            done = functools.partial(_damaged, (name, info, dest), reader._root,
                                     problems) if check else None
            ranges.append(_Range(path, info.offset, dest, done))
            continue
        split.append((name, info, dest))
        for piece in range(0, len(dest), READ_PIECE):
            ranges.append(_Range(path, info.offset + piece, dest[piece:piece + READ_PIECE]))
    reader._read(ranges)
    if check and split:
        list(_readers(reader.threads).map(lambda item: _damaged(item, reader._root, problems),
                                          split))
    if problems:
        raise DamagedCheckpoint(sorted(problems))
    for target in through:
        target.copy_(scratch[id(target)], non_blocking=True)
    if gpu:
        torch.cuda.current_stream().synchronize()  # before the pinned scratch goes
    return {name: bytes(buf) for name, buf in buffers.items()}


def _byte_view(target: torch.Tensor) -> memoryview:
    """The bytes of a tensor that needs no scratch copy (:func:`_needs_scratch`), to read
    into: made from its address, at half the cost of :func:`tensor_bytes` (1.2 against
    2.5 us here, most of a 300-tensor load's mapping), since a parameter's numpy view
    is refused for needing grad. It does not hold the tensor: the caller does, for as
    long as the view is used."""
    return memoryview((ctypes.c_char * target.nbytes).from_address(target.data_ptr())).cast("B")


def _needs_scratch(target: torch.Tensor) -> bool:
    """A destination that cannot be read into directly: on a GPU, not contiguous, or a
    tensor subclass (its own ``copy_`` does the conversion)."""
    return not (target.is_cpu and target.is_contiguous() and type(target) is torch.Tensor)


def _damaged(item: tuple[str, StoredItem, memoryview], root: str,
             problems: list[str]) -> None:
    """Hashes one item's bytes as read (hashing lets go of the GIL, so reading threads
    check in parallel) and adds a problem naming it when its sum differs."""
    name, info, data = item
    expected = item_sum(info)
    if expected is None:
        raise ValueError(f"{info.relative_path}: {name} has no recorded sum to check")
    algorithm, digest = expected
    if checksum.of(data, algorithm) != digest:
        problems.append(f"{posixpath.join(root, info.relative_path)}: {algorithm} differs "
                        f"from the manifest in {name} (bytes {info.offset}-"
                        f"{info.offset + info.length}; corrupted)")


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


def stored_object(data: bytes):
    """A non-tensor item as DCP stores it (a ``torch.save`` archive): its pickle read by
    :class:`_PlainUnpickler` straight from the archive, about 7x cheaper than opening it
    with torch's archive reader and 100x cheaper than ``torch.load``, whose per-call setup
    was most of the cost of a restart's two dozen small items (the optimizer's
    hyperparameters); an item holding anything else (tensors, in checkpoints written
    before the RNG state was plain values) goes to ``torch.load(weights_only=True)``."""
    try:
        return _PlainUnpickler(io.BytesIO(_pickle_record(data))).load()
    except Exception:  # what it cannot read, torch.load reads, refuses or explains
        with torch.serialization.safe_globals([io.BytesIO]):
            return torch.load(io.BytesIO(data), weights_only=True)


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
    state: dict = {}  # filled from the metadata by the planner, as dcp_to_torch_save does
    _load_state_dict(state, storage_reader=ShardReader(url, threads=threads),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def _runs(ranges: list[_Range], limit: int, iovecs: int | None) -> list[list[_Range]]:
    """``ranges`` in file order, grouped into runs that one read can fill: back to back in
    one file, up to ``limit`` bytes (a range larger than that is a run of its own) and,
    where ``iovecs`` is given, that many ranges; without it, any ranges of up to
    ``limit`` bytes in all (a batch of ranges for an object store)."""
    runs: list[list[_Range]] = []
    run: list[_Range] = []
    size = end = 0
    path = None
    for r in sorted(ranges, key=_IN_FILE_ORDER):
        n = len(r.dest)
        if (not run or size + n > limit or iovecs is not None
                and (len(run) >= iovecs or r.path != path or r.start != end)):
            run = []
            runs.append(run)
            size = 0
        run.append(r)
        size, path, end = size + n, r.path, r.start + n
    return runs


def _stretches(runs: list[list[_Range]], count: int) -> list[list[list[_Range]]]:
    """``runs`` (in file order) cut into up to ``count`` consecutive stretches of about
    equal bytes."""
    total = sum(len(r.dest) for run in runs for r in run)
    stretches: list[list[list[_Range]]] = [[]]
    done = 0
    for run in runs:
        if stretches[-1] and len(stretches) < count and done >= total * len(stretches) / count:
            stretches.append([])
        stretches[-1].append(run)
        done += sum(len(r.dest) for r in run)
    return stretches


def _read_stretch(runs: list[list[_Range]]) -> None:
    """Reads consecutive runs in order, through descriptors of this thread's own."""
    fds: dict[str, int] = {}
    try:
        for run in runs:
            path = run[0].path
            if path not in fds:
                fds[path] = os.open(path, os.O_RDONLY)
            _preadv(fds[path], run)
    finally:
        for fd in fds.values():
            os.close(fd)


def _preadv(fd: int, run: list[_Range]) -> None:
    """Fills a run of back-to-back ranges with ``preadv`` calls, then runs their
    ``done``; a short read goes on from where it stopped, the end of file raises."""
    views = [r.dest for r in run]
    at = run[0].start
    while views:
        n = os.preadv(fd, views, at)
        if n == 0:
            left = sum(len(v) for v in views)
            raise OSError(f"{run[0].path}: ends at {at}, {left} bytes short (truncated)")
        at += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if views and n:
            views[0] = views[0][n:]
    for r in run:
        if r.done is not None:
            r.done()
