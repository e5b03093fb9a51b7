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
from llmtrain.checkpoint.staging import host_block
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
    began = time.perf_counter()
    scratch = dict(zip(map(id, through), host_block(through, pin=gpu)[1])) if through else {}
    made = time.perf_counter()
    address = np.array(pointers if not through else [
        scratch[id(t)].data_ptr() if id(t) in scratch else t.data_ptr() for t in targets],
        np.int64)
    problems: list[str] = []
    checks = _checks(layout.places, address, plan.sum, plan.name, problems) if check else None
    read_scheduled(reader._fs, layout.schedule, address, reader.threads, checks)
    if problems:
        raise DamagedCheckpoint(sorted(problems))
    read = time.perf_counter()
    for target in through:
        target.copy_(scratch[id(target)], non_blocking=True)
    if gpu:
        torch.cuda.current_stream().synchronize()  # before the pinned scratch goes
    if through:  # where a load through a host block spends its time (a GPU restart's most)
        log.info("checkpoint load: %.2f GB through a%s host block: made in %.2f s, read%s "
                 "in %.2f s, copied in %.2f s", sum(v.nbytes for v in scratch.values()) / 1e9,
                 " pinned" if gpu else "", made - began, " and checked" if check else "",
                 read - made, time.perf_counter() - read)


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
