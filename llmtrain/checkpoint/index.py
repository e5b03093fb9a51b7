"""Where each stored item of a checkpoint is: ITEMS.json (every item) and INDEX2.bin (each
rank's own, found in O(its items)).

DCP's ``.metadata`` says where every item is, but as a pickle of every rank's items. Two
plain-data indexes beside it (both in the manifest, so verified like the data):

- :data:`ITEMS`, every stored item as JSON rows, for a resharding restart and the tools;
- :data:`INDEX`, for a restart at the saved world size: a table of one entry per rank
  pointing to the sections holding its items (see :func:`write_index`), so that each rank
  reads a 64-byte entry and its sections, whatever the world size. A section keeps its
  tensor chunks in columns (:class:`Section`): a key line each (name, offset, shape,
  dtype) and arrays of their places and sums, so that a rank matches its live shards to
  them as two lists of strings and reads them from arrays, with no Python object made per
  tensor (at about 300 tensors a rank, parsing them as rows was half of a warm 2-rank
  load's own time here).

Checkpoints written before columns have :data:`INDEX_ROWS` instead (the same table, its
sections JSON rows), which loads as well. The new layout has a file name of its own so
that an llmtrain of that time, which refuses an INDEX.bin it cannot read as damaged,
finds none in a new checkpoint and reads ITEMS.json instead: a downgrade mid-run loses
no checkpoint.
"""

from __future__ import annotations

import functools
import json
import struct
from collections import Counter
from typing import NamedTuple

import numpy as np
import torch

from llmtrain.checkpoint import checksum

RAW = "llmtrain-raw/1"  # the transform descriptor of an item stored as bare tensor bytes
ITEMS = "ITEMS.json"    # every stored item's place, as plain data (beside DCP's .metadata)
INDEX = "INDEX2.bin"    # each rank's own items, found in O(its items) (see write_index)
INDEX_ROWS = "INDEX.bin"  # the same with sections of JSON rows, as written before columns
SECTION = struct.Struct("<QQ16s")             # offset, length, xxh3_128 digest
ENTRY = struct.Struct("<QQ16sQQ16s")          # a rank's shared section, then its own
FOOT = struct.Struct("<8sQ")                  # magic, world size of the save
MAGIC = b"LLMIDX02"                           # INDEX's: sections in columns
MAGIC_ROWS = b"LLMIDX01"                      # INDEX_ROWS's (read, no longer written)
_HEAD = struct.Struct("<I")                   # a columnar section's JSON head, its length
SUMMED = "xxh3_128"                          # the sum of the items a section's columns hold


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
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rows(items: Items) -> list:
    return [[fqn, offset, *item._replace(dtype=None if item.dtype is None else
                                         _dtype_name(item.dtype))]
            for (fqn, offset), item in items.items()]


def items_json(items: Items) -> bytes:
    """ITEMS.json: what ``.metadata`` says of each stored item, as JSON rows, so a restart
    finds its items without unpickling ``.metadata`` (1.3-2.3 ms for 600 items here,
    against 0.4 ms to parse this; and nothing to unpickle at all)."""
    return json.dumps({"format": 1, "items": _rows(items)}, separators=(",", ":")).encode()


_DTYPES: dict[str, torch.dtype] = {}  # dtype names met in indexes, resolved once


def _dtype(name: str, where: str) -> torch.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{where}: {name!r} is not a torch dtype")
        _DTYPES[name] = dtype
    return dtype


def parse_rows(rows: list, where: str) -> Items:
    """:data:`Items` from rows of ITEMS.json or an INDEX2.bin section. A plain loop making
    each StoredItem as a tuple: 0.14 ms for 330 rows here, against 0.24 ms for a
    comprehension calling a dtype lookup and the named tuple's constructor (a resharding
    restart parses every rank's rows)."""
    items: Items = {}
    new = tuple.__new__
    for fqn, offset, path, start, length, descriptors, sizes, name in rows:
        items[(fqn, None if offset is None else tuple(offset))] = new(
            StoredItem, (path, start, length, descriptors,
                         None if sizes is None else tuple(sizes),
                         None if name is None else _dtype(name, where)))
    return items


def key_line(fqn: str, offset, sizes, dtype: torch.dtype) -> str:
    """A tensor chunk's key in a section's columns: its name, global offset, shape and
    dtype. A live shard with the same line is read from that chunk as it is."""
    return (f"{fqn}\t{','.join(map(str, offset))}\t{','.join(map(str, sizes))}\t"
            f"{_dtype_name(dtype)}")


def _in_columns(key: tuple, item: StoredItem) -> bytes | None:
    """The digest of an item that goes in a section's columns (a raw tensor chunk with an
    XXH3-128 sum and a name that fits a line), else None: it goes in the rows."""
    fqn, offset = key
    descriptors = item.transform_descriptors
    if (item.sizes is None or offset is None or len(descriptors) != 2
            or descriptors[0] != RAW or "\t" in fqn or "\n" in fqn):
        return None
    algorithm, digest = checksum.parse(descriptors[1]) or (None, None)
    return bytes.fromhex(digest) if algorithm == SUMMED else None


class Section:
    """A rank's items from its sections of INDEX2.bin: tensor chunks in columns (their key
    lines, ``text``, and in the same order the index of the file in ``files``, the start
    and length of the bytes, and the XXH3-128 digests, 16 bytes each) and the other items
    as ``rows``; ``layout``: the lines, files and places as stored (equal bytes, the same
    layout; empty where there is none to compare)."""

    def __init__(self, text: bytes, files: list[str], file: np.ndarray, start: np.ndarray,
                 length: np.ndarray, digests: bytes, rows: Items, layout: bytes = b""):
        self.text, self.files, self.file, self.start, self.length = (text, files, file,
                                                                     start, length)
        self.digests, self.rows, self.layout = digests, rows, layout

    @functools.cached_property
    def lines(self) -> list[str]:
        """The key line of each column (:func:`key_line`), split when first asked for: a
        load whose layout was seen before compares ``layout`` instead."""
        return self.text.decode().split("\n") if len(self.file) else []

    def items(self) -> Items:
        """Every item as :data:`Items` (a Python object per item: for the paths that look
        items up one by one)."""
        items: Items = {}
        for i, line in enumerate(self.lines):
            fqn, offset, sizes, dtype = line.split("\t")
            digest = self.digests[16 * i:16 * i + 16].hex()
            items[(fqn, _ints(offset))] = StoredItem(
                self.files[self.file[i]], int(self.start[i]), int(self.length[i]),
                [RAW, checksum.label(digest, SUMMED)], _ints(sizes), _dtype(dtype, INDEX))
        return items | self.rows


EMPTY = (np.zeros(0, "<u4"), np.zeros(0, "<u8"), np.zeros(0, "<u8"))  # no columns


def rows_only(items: Items) -> Section:
    """A section of rows alone (an index written before columns, every stored item)."""
    return Section(b"", [], *EMPTY, b"", items)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(map(int, text.split(","))) if text else ()


def _section_bytes(body: dict, items: Items, keys: list[tuple]) -> bytes:
    """A section: a JSON head (``body``, the files, the column sizes, the rows), the key
    lines, then the columns (file index u32, start u64, length u64, digest 16 bytes)."""
    lines, files, file, start, length, digests, rows = [], {}, [], [], [], [], {}
    for key in keys:
        item = items.get(key)
        if item is None:
            continue
        digest = _in_columns(key, item)
        if digest is None:
            rows[key] = item
            continue
        lines.append(key_line(key[0], key[1], item.sizes, item.dtype))
        file.append(files.setdefault(item.relative_path, len(files)))
        start.append(item.offset)
        length.append(item.length)
        digests.append(digest)
    text = "\n".join(lines).encode()
    head = json.dumps({**body, "files": list(files), "n": len(lines), "lines": len(text),
                       "items": _rows(rows)}, separators=(",", ":")).encode()
    return b"".join([_HEAD.pack(len(head)), head, text, np.array(file, "<u4").tobytes(),
                     np.array(start, "<u8").tobytes(), np.array(length, "<u8").tobytes(),
                     *digests])


def parse_section(data: bytes, where: str, columns: bool) -> tuple[dict, Section]:
    """(head, items) of one section of INDEX2.bin (or INDEX.bin), already checked against
    its digest; ``columns``: the file's layout (else a section of JSON rows)."""
    if not columns:
        body = json.loads(data)
        return body, rows_only(parse_rows(body.pop("items"), where))
    (size,) = _HEAD.unpack_from(data)
    at = _HEAD.size + size
    head = json.loads(data[_HEAD.size:at])
    n, text = head["n"], head["lines"]
    if len(data) != at + text + 36 * n:
        raise ValueError(f"{where}: a section of {len(data)} bytes for {n} items")
    places = at + text
    layout = b"\0".join([b"columns", *map(str.encode, head["files"]), data[at:places + 20 * n]])
    return head, Section(data[at:places], head["files"],
                         np.frombuffer(data, "<u4", n, places),
                         np.frombuffer(data, "<u8", n, places + 4 * n),
                         np.frombuffer(data, "<u8", n, places + 12 * n), data[places + 20 * n:],
                         parse_rows(head.pop("items"), where), layout)


def merged(sections: list[Section]) -> Section:
    """One rank's sections as one (file indices renumbered into one list of files)."""
    layout = b"\1".join(s.layout for s in sections) if all(s.layout for s in sections) else b""
    rows = {k: v for s in sections for k, v in s.rows.items()}
    tabled = [s for s in sections if len(s.file)]
    if len(tabled) <= 1:  # the usual case: replicated items are bytes, in rows
        s = tabled[0] if tabled else sections[0]
        return Section(s.text, s.files, s.file, s.start, s.length, s.digests, rows, layout)
    files: dict[str, int] = {}
    file = []
    for s in tabled:
        renumbered = np.array([files.setdefault(f, len(files)) for f in s.files], np.int64)
        file.append(renumbered[s.file])
    return Section(b"\n".join(s.text for s in tabled), list(files), np.concatenate(file),
                   np.concatenate([s.start for s in tabled]),
                   np.concatenate([s.length for s in tabled]),
                   b"".join(s.digests for s in tabled), rows, layout)


class IndexLayout(NamedTuple):
    """Which items go in which section of INDEX2.bin (see :func:`write_index`)."""
    shared: list[list[tuple]]             # each distinct set of items several ranks hold
    ranks: list[tuple[int, list[tuple]]]  # each rank's: its set in ``shared``, its own items


def index_layout(needs: list[list[tuple]]) -> IndexLayout:
    """The sections of INDEX2.bin for ranks holding ``needs[rank]`` (keys of :data:`Items`,
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
    """INDEX2.bin, written to ``stream``: for each rank of the save, the stored items of the
    state it held, so that a restart at the saved world size reads a 64-byte table entry
    and its sections: O(its own items), where ITEMS.json and ``.metadata`` list every
    rank's (O(world) bytes for each rank, O(world^2) in all).

    Each rank's items are in two sections (``layout``): those other ranks hold too
    (replicated items, an HSDP replica's shards), in a section written once for all the
    ranks holding the same ones, and its own alone; so the file grows with the distinct
    items, as ITEMS.json does, not with world x items, and so does the time to write it.
    Layout: the sections (:class:`Section`; the head holds the world size, and the rank
    for its own), written as they are made; one entry per rank (offset, length and
    XXH3-128 digest of each of its two sections); a footer (magic, world size) that a
    reader finds from the file's end."""
    world, offset = len(layout.ranks), 0

    def put(body: dict, keys: list[tuple]) -> bytes:
        nonlocal offset
        data = _section_bytes(body, items, keys)
        stream.write(data)
        offset += len(data)
        return SECTION.pack(offset - len(data), len(data), digest(data))

    shared = [put({"world": world}, keys) for keys in layout.shared]
    table = [shared[group] + (put({"rank": rank, "world": world}, own) if own
                              else SECTION.pack(0, 0, bytes(16)))
             for rank, (group, own) in enumerate(layout.ranks)]
    stream.write(b"".join(table))
    stream.write(FOOT.pack(MAGIC, world))


def entry_offset(size: int, rank: int, world: int) -> int:
    """Where ``rank``'s table entry starts in an index of ``size`` bytes saved at
    ``world`` ranks (negative: the file holds fewer entries)."""
    return size - FOOT.size - ENTRY.size * (world - rank)


def entry(data: bytes, rank: int, world: int) -> tuple:
    """``rank``'s table entry of a whole index: (shared section's offset, length,
    digest, own section's offset, length, digest)."""
    return ENTRY.unpack_from(data, entry_offset(len(data), rank, world))


def digest(data: bytes) -> bytes:
    """A section's XXH3-128 digest, as the table holds it."""
    hasher = checksum.new()
    hasher.update(data)
    return hasher.digest()
