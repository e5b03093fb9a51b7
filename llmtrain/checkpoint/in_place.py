"""A load in place: a restart at the world size of the save, without DCP's planning.

Each live shard is matched to its saved chunk among the rank's own items (its sections of
INDEX2.bin, see :mod:`llmtrain.checkpoint.index`; else ITEMS.json, the places
``.metadata`` lists, as plain data: nothing is unpickled) and read into at that place
(:func:`plan_in_place`, :func:`read_in_place`, :func:`read_objects`), and checked against
its sum once read, so a resume reads its data once, not once to verify it and again to
load it. When a live tensor or a saved chunk has no match (a resharding load, a
checkpoint written before the raw format), DCP's planner is the way
(:class:`.shard_read.ShardReader`).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import logging
import posixpath
import time
from typing import Callable, NamedTuple

import numpy as np
import torch

from llmtrain.checkpoint import checksum, index
from llmtrain.checkpoint.index import RAW, Section, StoredItem
from llmtrain.checkpoint.range_read import (Places, ReadSchedule, read_scheduled,
                                            schedule_reads)
from llmtrain.checkpoint.shard_read import DamagedCheckpoint, ShardReader, item_sum
from llmtrain.checkpoint.staging import host_block, page_span
from llmtrain.fsio import is_local

log = logging.getLogger(__name__)

OBJECTS_GAP = 1 << 20   # bytes between two objects of a file that one read of both spans


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
    schedule: ReadSchedule
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
        """The FQN of the tensor of a row."""
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
    :func:`.shard_write.write_shards`) takes it as it is, its lines, files and places
    compared byte for byte, not matched again."""
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
    """The live tensors matched to ``section``'s chunks (see :func:`plan_in_place`);
    None when one has no chunk or a chunk no tensor."""
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
    return _Layout(targets, list(files), places, schedule_reads(places, is_local(reader._fs)),
                   chosen, keys, all(t.is_cpu and type(t) is torch.Tensor for t in targets))


def _rooted(layout: _Layout, root: str) -> _Layout:
    """A kept layout with its files in the checkpoint at ``root``."""
    paths = [posixpath.join(root, f) for f in layout.files]
    return layout._replace(places=layout.places._replace(paths=paths),
                           schedule=layout.schedule._replace(paths=paths))


def read_objects(reader: ShardReader, plan: InPlace, *, check: bool = False) -> dict[str, bytes]:
    """The stored bytes of ``plan``'s objects, {name: bytes}, a file at a time: the
    objects of a file lie together (after its tensors, see
    :func:`.shard_write.write_shards`), so each file's are one positional read or
    request, or a few where they lie far apart. A few dozen small items: the arrays and
    threads of :func:`.range_read.read_scheduled` took 0.7 ms of a 2-rank load's Python
    here, this 0.3. ``check``: each is compared with its recorded sum, and
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
                _check(file.path, name, item_sum(item), got[name], item.offset, item.length,
                       problems)
    if problems:
        raise DamagedCheckpoint(sorted(problems))
    return got


def _check(path: str, name: str, expected: tuple[str, str] | None, data, start: int,
           length: int, problems: list[str]) -> None:
    """Adds a problem naming item ``name`` (bytes ``start`` to ``start + length`` of
    ``path``) when ``data``, its bytes as read, differ from ``expected``, its recorded
    (algorithm, hex digest)."""
    if expected is None:
        raise ValueError(f"{path}: {name} has no recorded sum to check")
    algorithm, digest = expected
    if checksum.of(data, algorithm) != digest:
        problems.append(f"{path}: {algorithm} differs from the manifest in {name} "
                        f"(bytes {start}-{start + length}; corrupted)")


def read_in_place(reader: ShardReader, plan: InPlace, *, check: bool = False) -> None:
    """Reads every live tensor of ``plan`` from its saved chunk straight into its memory:
    parallel range reads without DCP's planning (about 0.2 ms of Python per item, most
    of a warm load's time).

    A destination that cannot be read into (on a GPU, not contiguous, a tensor subclass)
    is read through host memory: two slots of at least ``STAGE`` bytes (pinned for a GPU),
    one read into while the other's tensors are copied out (on a GPU, on a stream of
    their own), so that a load of any size touches only the slots' memory. New host
    memory is not free: its pages are faulted in and zeroed at first touch, 1.2 GB/s on
    this project's 2-core VM, so a block as large as the state cost a 13 GB load about
    as long as reading it (one H200 VM loaded 13.3 GB in about 10 s that way).

    ``check``: every tensor read is hashed (on the reading threads, while it is in the
    cache) and compared with its recorded sum; a difference raises DamagedCheckpoint,
    with the destination tensors of the slots read so far already overwritten."""
    layout = plan.layout
    targets = layout.targets
    # each tensor's metadata is touched once (after a large read it is out of the
    # caches: at 2 ranks here each pass over 300 tensors took 0.1-0.3 ms)
    pointers = ([t.data_ptr() if t.is_contiguous() else -1 for t in targets] if layout.on_cpu
                else [-1] * len(targets))
    through = ([row for row, at in enumerate(pointers) if at == -1 and _needs_scratch(
        targets[row])] if -1 in pointers else [])
    problems: list[str] = []
    if not through:
        address = np.array(pointers, np.int64)
        checks = _checks(layout.places, address, plan.sum, plan.name, problems) if check else None
        read_scheduled(reader._fs, layout.schedule, address, reader.threads, checks)
    else:
        _read_through(reader, plan, through, check, problems)
    if problems:
        raise DamagedCheckpoint(sorted(problems))


STAGE = 512 << 20  # bytes of each of a load's two host slots (more for a larger tensor)
_reserved: list[torch.Tensor] = []  # pinned slots made ahead of the load (reserve_slots)


def reserve_slots() -> None:
    """Makes and pins a GPU load's two host slots now, for this process's next load
    through host slots to take: a prepared worker pays this while it waits (0.59 s of a
    13 GB load's 3.1 s on an H200). Kept until that load, or :func:`release_slots`."""
    if not _reserved:
        shape = torch.empty(STAGE, dtype=torch.uint8, device="meta")
        _reserved.extend(host_block([shape], pin=True)[0] for _ in range(2))


def release_slots() -> None:
    """Lets go of slots :func:`reserve_slots` made that no load took (nothing to resume
    from): they are pinned host memory."""
    _reserved.clear()


def _read_through(reader: ShardReader, plan: InPlace, through: list[int], check: bool,
                  problems: list[str]) -> None:
    """:func:`read_in_place` where the rows ``through`` are read through host slots and
    copied out, and the other rows (plain contiguous CPU tensors) are read into."""
    targets = plan.layout.targets
    skipped = set(through)
    direct = [row for row in range(len(targets)) if row not in skipped]
    if direct:
        _read_rows(reader, plan, direct, [targets[row].data_ptr() for row in direct], check,
                   problems)
    nbytes = [targets[row].numel() * targets[row].element_size() for row in through]
    spans = list(map(page_span, nbytes))  # each tensor starts a page of its slot
    slot_bytes = max(min(STAGE, sum(spans)), max(spans))  # a small state: one slot its size
    batches: list[list[int]] = [[]]  # indices into through, each batch filling one slot
    filled = 0
    for k, n in enumerate(spans):
        if batches[-1] and filled + n > slot_bytes:
            batches.append([])
            filled = 0
        batches[-1].append(k)
        filled += n
    gpu = any(targets[row].device.type == "cuda" for row in through)
    began = time.perf_counter()
    # anonymous memory pinned where it lies (torch's pinned allocator would round each
    # slot up to a power of two and keep it cached for the rest of the run)
    ahead = gpu and bool(_reserved) and _reserved[0].numel() >= slot_bytes
    if ahead:
        slots = _reserved[:min(2, len(batches))]
    else:
        slot_shape = torch.empty(slot_bytes, dtype=torch.uint8, device="meta")
        slots = [host_block([slot_shape], pin=gpu)[0] for _ in range(min(2, len(batches)))]
    release_slots()  # the load's own from here: they go with it
    made = time.perf_counter()
    stream = torch.cuda.Stream() if gpu else None
    if stream is not None:  # the copies come after whatever the live tensors had queued
        stream.wait_stream(torch.cuda.current_stream())
    copied: list = [None] * len(slots)  # the event of each slot's last copies (a GPU's)
    try:
        for b, batch in enumerate(batches):
            slot = slots[b % len(slots)]
            if copied[b % len(slots)] is not None:
                copied[b % len(slots)].synchronize()  # its last tensors are out of it
            offsets = np.cumsum([0] + [spans[k] for k in batch])[:-1]
            rows = [through[k] for k in batch]
            _read_rows(reader, plan, rows, [slot.data_ptr() + int(o) for o in offsets], check,
                       problems)
            if problems:
                break
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for row, k, at in zip(rows, batch, offsets):
                    target = targets[row]
                    view = slot[int(at):int(at) + nbytes[k]].view(target.dtype).view(target.shape)
                    target.copy_(view, non_blocking=gpu)
                if stream is not None:
                    copied[b % len(slots)] = stream.record_event()
    finally:
        read = time.perf_counter()
        if stream is not None:
            stream.synchronize()  # before the slots go, whatever ended the reads
            torch.cuda.current_stream().wait_stream(stream)
    log.info("checkpoint load: %.2f GB through %d %shost slot(s) of %.0f MB in %d batch(es): "
             "slots made %s, read%s and copied in %.2f s, the last copies in %.2f s",
             sum(nbytes) / 1e9, len(slots), "pinned " if gpu else "", slot_bytes / 1e6,
             len(batches), "ahead" if ahead else f"in {made - began:.2f} s",
             " and checked" if check else "", read - made, time.perf_counter() - read)


def _read_rows(reader: ShardReader, plan: InPlace, rows: list[int], address: list[int],
               check: bool, problems: list[str]) -> None:
    """Reads ``plan``'s rows ``rows`` to ``address`` (one each), checked where ``check``."""
    places = plan.layout.places
    picked = np.array(rows, np.int64)
    some = Places(places.paths, places.file[picked], places.start[picked],
                  places.length[picked])
    at = np.array(address, np.int64)
    checks = (_checks(some, at, lambda r: plan.sum(rows[r]), lambda r: plan.name(rows[r]),
                      problems) if check else None)
    read_scheduled(reader._fs, schedule_reads(some, is_local(reader._fs)), at, reader.threads,
                   checks)


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
    data = (ctypes.c_char * length).from_address(int(address[row]))
    _check(places.paths[places.file[row]], name_of(row), sum_of(row), data, start, length,
           problems)
