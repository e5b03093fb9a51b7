"""Checkpoint storage: DCP files through fsspec, a manifest that commits them, verification.

Layout of one checkpoint, ``<checkpoint url>/step-00000100/``::

    __0_0.distcp ...   DCP shards, up to ``writer_threads`` per rank (a rank may have
                       none: DCP writes a replicated tensor once); tensors as raw
                       bytes, see :mod:`llmtrain.checkpoint.shard_write`
    .metadata          DCP's index of the shards (a pickle)
    ITEMS.json         the same places of the stored items, as plain data, for a restart
                       at the saved world size (it needs nothing else from .metadata)
    MANIFEST.json      written last, by rank 0, once every rank's files are written:
                       step, world, config digest, timings, and each file's size and sum:
                       ``sha256`` of the file (``.metadata``, checkpoints before item sums),
                       or ``items_sha256`` of a shard file: the sha256 of its items' own
                       digests in file order, each recorded with its item in ``.metadata``
                       (XXH3-128; SHA-256 before, :mod:`llmtrain.checkpoint.checksum`)

The commit protocol: each rank hashes its shards *while writing them* (no read-back), item
by item, and hands the sums to the coordinator inside DCP's own gather of write results;
after DCP has written ``.metadata``, the coordinator creates ``MANIFEST.json`` with
:func:`llmtrain.fsio.create_atomic`: whole or not at all, and never over a manifest that is
there already (see :mod:`llmtrain.fsio` for what each storage kind guarantees). A directory
without a manifest is incomplete and never loaded. Creating, committing, removing and
quarantining are each fenced (:mod:`llmtrain.recovery.fence`): a rank cut off from the job
does none of them.

Security rule: no load runs code from the checkpoint. A restart at the saved world size
in the raw format reads INDEX2.bin (or ITEMS.json) and decodes the non-tensor items with
an unpickler that builds plain values only
(:func:`llmtrain.checkpoint.safe_unpickle.stored_object`). A load DCP plans (the dcp
format, a resharding load, a checkpoint written before ITEMS.json) reads ``.metadata``
through an unpickler of DCP's index classes only (``ShardReader.read_metadata``), where
DCP calls ``pickle.load``, and its items through the same plain-values decoder
(:class:`llmtrain.checkpoint.safe_unpickle.PlainObjectsPlanner`), where DCP calls
``torch.load(weights_only=False)``; tensors stored as ``torch.save`` records are read
with ``torch.load(weights_only=True)``. :func:`verify` checks every file against the
manifest before any of them is opened, which protects against corruption and files
swapped in from elsewhere; someone able to rewrite the manifest too can have a resume
load other values, not run code. Stock DCP tools outside llmtrain unpickle ``.metadata``
and the items as they are.

Item sums let a reader check exactly the bytes it reads: a restart at the saved world size
checks each item as it loads it (:func:`llmtrain.checkpoint.in_place.read_in_place`) and
reads the checkpoint once, where a whole-file check must read every file before the load
reads it again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import posixpath
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import fsspec
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter
from torch.futures import Future

from llmtrain import fault_points
from llmtrain.checkpoint import checksum, direct_io, index, shard_read, shard_write
from llmtrain.fsio import (FILE_MODE, create_atomic, is_local, join, makedirs, set_mode, sync_dir,
                           write_atomic)

MANIFEST = "MANIFEST.json"
REJECTED = "REJECTED.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(root: str, step: int) -> str:
    return join(root, f"step-{step:08d}")


class _HashingStream:
    """Passes writes through, hashing each piece in the writing thread just before it is
    written, while it is still in the CPU cache: plain writes into the file's sha256,
    ``write_item`` into the item's own checksum (a file is written one way or the
    other)."""

    PIECE = 4 << 20  # well inside L2/L3

    def __init__(self, stream, *, local: bool):
        self._stream = stream
        self._sha = hashlib.sha256()
        self._items: list[bytes] = []
        self.size = 0
        self._fd = stream.fileno() if local else None
        self._flushed = 0  # bytes handed to the kernel's writeback so far

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._sha.update(view)
        self.size += len(view)
        return self._stream.write(view)

    def write_item(self, data) -> str:
        """Writes one stored item; returns its checksum, labelled (``xxh3_128=<hex>``)."""
        view = memoryview(data).cast("B")
        algorithm = checksum.DEFAULT
        hasher = checksum.new(algorithm)
        for start in range(0, len(view), self.PIECE):
            piece = view[start:start + self.PIECE]
            hasher.update(piece)
            self._stream.write(piece)
            self.size += len(piece)
            self._write_back()
        self._items.append(hasher.digest())
        return checksum.label(hasher.hexdigest(), algorithm)

    def _write_back(self) -> None:
        """Starts the disk writing what is written so far, in the background (a local
        file: fadvise DONTNEED starts writeback of dirty pages without waiting), so the
        final fsync waits only for the tail: the disk works while the next pieces are
        hashed, instead of after all of them."""
        if self._fd is None or self.size - self._flushed < self.PIECE:
            return
        self._stream.flush()
        os.posix_fadvise(self._fd, self._flushed, self.size - self._flushed,
                         os.POSIX_FADV_DONTNEED)
        self._flushed = self.size

    def sums(self) -> dict[str, Any]:
        if self._items:
            assert self._sha.digest() == hashlib.sha256().digest(), "items and plain writes"
            return {"size": self.size, "items_sha256": items_sha256(self._items)}
        return {"size": self.size, "sha256": self._sha.hexdigest()}

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class _HashingFileSystem(FileSystem):
    """DCP's fsspec filesystem, recording {file name: size, sha256} of what it writes and
    fsyncing each file it wrote where the storage needs it: local disks and NFS/FUSE
    mounts. Object stores need none (an object is durable once its upload completes), and
    DCP's own ``sync_files`` would fall back to ``os.sync()`` of the whole node there.
    Local files are written around the page cache where ``direct_io`` says
    (:mod:`llmtrain.checkpoint.direct_io`)."""

    def __init__(self, fence: Callable[[str], None], direct_io: str = "auto") -> None:
        super().__init__()
        self.sums: dict[str, dict[str, Any]] = {}
        self.fence, self.direct_io = fence, direct_io

    def mkdir(self, path) -> None:
        makedirs(os.fspath(path), self.fs)

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" in mode:  # the last moment a rank cut off from the job can be stopped
            self.fence(f"checkpoint file {os.fspath(path)}")
        local, target = is_local(self.fs), os.fspath(path)
        direct = None
        if "w" in mode and local and direct_io.wanted(target, self.direct_io):
            direct = direct_io.open_direct(target, FILE_MODE)
        with direct or super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            if local:
                set_mode(target, FILE_MODE)
            # nothing of a direct file is in the page cache to start writing back
            hashed = _HashingStream(stream, local=local and direct is None)
            yield hashed
            if direct is not None:
                direct.finish()
            if local:
                stream.flush()
                os.fsync(stream.fileno())
            self.sums[posixpath.basename(target)] = hashed.sums()


def no_fence(what: str) -> None:
    """No fence: every writer is a member of the job."""


class CommitWriter(FsspecWriter):
    """An fsspec DCP writer of raw tensor bytes, or with ``raw`` False of DCP's own items
    (:mod:`llmtrain.checkpoint.shard_write`), whose ``finish`` also commits the
    checkpoint's manifest. ``fence(what)`` raises when this rank may no longer write into
    the job's storage (:mod:`llmtrain.recovery.fence`); it is asked before every file is
    created, and before the commit. ``nice``: the write threads' added niceness. ``direct_io``:
    where local files go around the page cache (``checkpoint.direct_io``). ``planner``:
    the save's planner, whose ``index_layout`` (each rank's own items, where it has one)
    the commit writes as the per-rank index, INDEX2.bin."""

    def __init__(self, url: str, manifest: dict[str, Any], *, thread_count: int = 1,
                 fence: Callable[[str], None] = no_fence, raw: bool = True, nice: int = 0,
                 direct_io: str = "auto", planner: object = None):
        super().__init__(url, thread_count=thread_count, sync_files=False, overwrite=True)
        self.fence, self.raw, self.nice, self.planner = fence, raw, nice, planner
        hashing = _HashingFileSystem(fence, direct_io)
        hashing.fs = self.fs.fs
        self.fs = hashing
        self.url = url
        self.manifest = {**manifest, "format": "raw" if raw else "dcp"}

    def prepare_global_plan(self, plans):
        # A save of this step may have failed here before: start from an empty directory
        # so no stale shard or old manifest survives next to the new files. Nothing of
        # this save is written yet (every rank has only made the directory).
        fs = self.fs.fs
        self.fence(f"clearing {self.path} for a new save")
        if fs.exists(self.path):
            fs.rm(os.fspath(self.path), recursive=True)
        self.fs.mkdir(self.path)
        return super().prepare_global_plan(plans)

    def write_data(self, plan, planner):
        fault_points.point("checkpoint_write", step=self.manifest["step"])
        results = shard_write.write_shards(self.fs, self.path, plan, planner,
                                           self.thread_count, raw=self.raw,
                                           nice=self.nice).wait()
        # Carry each file's sums to the coordinator inside DCP's gather of the results;
        # ``finish`` takes them out again before DCP's metadata is pickled.
        sums = self.fs.sums
        tagged = [dataclasses.replace(r, storage_data=(r.storage_data,
                                                       sums[r.storage_data.relative_path]))
                  for r in results]
        fut: Future = Future()
        fut.set_result(tagged)
        return fut

    def finish(self, metadata, results) -> None:
        files: dict[str, dict[str, Any]] = {}
        plain = []
        for rank_results in results:
            plain.append([])
            for r in rank_results:
                info, sums = r.storage_data
                files[info.relative_path] = sums
                plain[-1].append(dataclasses.replace(r, storage_data=info))
        # set here, not left to DCP's finish: torch 2.11's fills in a copy of ``metadata``
        metadata.storage_data = {r.index: r.storage_data for rs in plain for r in rs}
        super().finish(metadata, plain)
        files[".metadata"] = self.fs.sums[".metadata.tmp"]
        items = index.metadata_items(metadata)
        indexes = {index.ITEMS: lambda f: f.write(index.items_json(items))}
        if layout := getattr(self.planner, "index_layout", None):
            indexes[index.INDEX] = lambda f: index.write_index(f, items, layout)
        for name, write in indexes.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as f:
                write(f)
            files[name] = self.fs.sums[name]
        self.fence(f"the commit of {self.url}")
        manifest = {**self.manifest, "files": dict(sorted(files.items())),
                    "bytes": sum(f["size"] for f in files.values()),
                    "committed_at": time.time()}
        # create-if-absent: a writer that passed the fence and then stalled cannot land its
        # manifest over the one a newer membership committed meanwhile (FileExistsError)
        create_atomic(join(self.url, MANIFEST), json.dumps(manifest, indent=1).encode())
        sync_dir(posixpath.dirname(self.url.rstrip("/")))  # the step directory's own name


@dataclass
class CheckpointInfo:
    step: int
    url: str
    committed: bool
    manifest: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # its manifest could not be read: committed or not, unknown

    @property
    def bytes(self) -> int:
        return self.manifest.get("bytes", 0)

    @property
    def age_s(self) -> float | None:
        at = self.manifest.get("committed_at")
        return time.time() - at if at else None


def read_manifest(url: str) -> dict[str, Any] | None:
    """The checkpoint's manifest; None when it has none (incomplete); ``{"unreadable":
    True}`` when its bytes are not a manifest. A read error (EIO, a timeout) raises: it
    says nothing about the checkpoint."""
    fs, path = fsspec.core.url_to_fs(join(url, MANIFEST))
    try:
        manifest = json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return None
    except ValueError:
        return {"unreadable": True}
    return manifest if isinstance(manifest, dict) else {"unreadable": True}


def list_checkpoints(root: str) -> list[CheckpointInfo]:
    """Every ``step-N`` directory under ``root``, oldest first. One whose manifest cannot be
    read (EIO, a permission, an object moved to an archive tier) is listed with its
    ``error``, neither committed nor incomplete: it blocks nothing newer, and nothing
    deletes it."""
    fs, path = fsspec.core.url_to_fs(root)
    if not fs.exists(path):
        return []
    out = []
    for entry in fs.ls(path, detail=False):
        match = _STEP_DIR.match(posixpath.basename(entry.rstrip("/")))
        if match:
            url = join(root, posixpath.basename(entry.rstrip("/")))
            try:
                manifest, error = read_manifest(url), None
            except OSError as e:
                manifest, error = None, f"{type(e).__name__}: {e}"[:500]
            out.append(CheckpointInfo(step=int(match.group(1)), url=url,
                                      committed=manifest is not None, manifest=manifest or {},
                                      error=error))
    return sorted(out, key=lambda c: c.step)


def retention_victims(ckpts: list[CheckpointInfo], keep_last: int,
                      keep_every: int) -> list[CheckpointInfo]:
    """What retention deletes: committed checkpoints beyond the newest ``keep_last`` that
    are not a multiple of ``keep_every``, and incomplete ones older than the newest
    committed (newer ones may still be being written). The newest committed always stays,
    and so does the newest whose state passed the integrity checks, and any whose manifest
    could not be read (it may be committed: only a person, or a later pass that reads it,
    decides).
    """
    committed = [c for c in ckpts if c.committed]
    if not committed:
        return []
    keep = {c.step for c in committed[-keep_last:]}
    checked = [c.step for c in committed if c.manifest.get("integrity_checked")]
    keep |= set(checked[-1:])
    if keep_every:
        keep |= {c.step for c in committed if c.step % keep_every == 0}
    newest = committed[-1].step
    return [c for c in ckpts if c.step not in keep and c.error is None
            and (c.committed or c.step < newest)]


def items_sha256(digests: list[bytes]) -> str:
    """A shard file's sum in the manifest: the sha256 of its items' digests."""
    return hashlib.sha256(b"".join(digests)).hexdigest()


def _file_sum(fs, path: str, algorithm: str = "sha256", start: int = 0,
              length: int | None = None) -> str:
    hasher = checksum.new(algorithm)
    with fs.open(path, "rb") as f:
        f.seek(start)
        left = fs.size(path) - start if length is None else length
        while left > 0 and (chunk := f.read(min(left, 8 << 20))):
            hasher.update(chunk)
            left -= len(chunk)
    return hasher.hexdigest()


def _items(url: str, root: str, fs, manifest: dict) -> dict[str, list] | str:
    """{shard file: [(first byte, length, name, (algorithm, digest)) of each item, in file
    order]} from the checkpoint's index (ITEMS.json, or ``.metadata`` where it has none),
    once the index's own sum matches the manifest's; a string saying why not otherwise."""
    listed = index.ITEMS if index.ITEMS in manifest["files"] else ".metadata"
    meta = manifest["files"].get(listed, {})
    path = posixpath.join(root, listed)
    if not fs.exists(path) or fs.size(path) != meta.get("size") or \
            _file_sum(fs, path) != meta.get("sha256"):
        return f"{url}/{listed}: damaged, so the item sums cannot be checked"
    out: dict[str, list] = {}
    for (fqn, _), item in shard_read.ShardReader(url).stored_items().items():
        out.setdefault(item.relative_path, []).append(
            (item.offset, item.length, fqn, shard_read.item_sum(item)))
    return {name: sorted(items) for name, items in out.items()}


def _damaged_items(url: str, fs, path: str, name: str, items: list, expect: str) -> list[str]:
    """The items of one shard file whose bytes differ from their sums."""
    problems = [f"{url}/{name}: {algorithm} differs from the manifest in {fqn} (bytes "
                f"{start}-{start + length}; corrupted)"
                for start, length, fqn, (algorithm, digest) in items
                if _file_sum(fs, path, algorithm, start, length) != digest]
    if not problems and items_sha256([bytes.fromhex(d) for *_, (_, d) in items]) != expect:
        problems.append(f"{url}/{name}: its item sums differ from the manifest's")
    return problems


# what lists the items, not data
INDEXES = (".metadata", index.ITEMS, index.INDEX, index.INDEX_ROWS)


def verify(url: str, *, checksums: bool, part: tuple[int, int] = (0, 1),
           items: bool = True, whole: bool = True, indexes: bool = True) -> list[str]:
    """What is wrong with the checkpoint at ``url`` (empty when it verifies).

    Sizes are always checked, sums when ``checksums``: a shard file item by item against
    the sums in ``.metadata`` (``items=False`` leaves that to the reader, which checks
    each item it reads), any other file whole (``whole=False``: not, as a check of the
    items after the rest; ``indexes=False``: not the files that list every rank's items,
    each O(world) bytes, for a resume that reads only its own section of INDEX2.bin, which
    it checks itself). ``part=(i, n)`` checks only every n-th file starting at i, so n
    ranks can share the reading of a large checkpoint.
    """
    manifest = read_manifest(url)
    if manifest is None:
        fs, root = fsspec.core.url_to_fs(url)
        if not fs.exists(root):
            return [f"{url}: no checkpoint there (nothing at that path; `llmtrain ckpt list "
                    f"CHECKPOINTS_DIR` lists a run's checkpoints)"]
        return [f"{url}: no {MANIFEST}, the save never completed"]
    if "files" not in manifest:
        return [f"{url}: {MANIFEST} is unreadable"]
    fs, root = fsspec.core.url_to_fs(url)
    problems = []
    share, count = part
    table = None  # the item sums, read once when a shard file needs them
    for name, expect in list(manifest["files"].items())[share::count]:
        path = posixpath.join(root, name)
        try:
            size = fs.size(path)
        except FileNotFoundError:
            problems.append(f"{url}/{name}: missing")
            continue
        if size != expect["size"]:
            problems.append(f"{url}/{name}: {size} bytes, manifest says {expect['size']}")
        elif not checksums:
            continue
        elif "items_sha256" not in expect:
            wanted = indexes if name in INDEXES else whole
            if wanted and _file_sum(fs, path) != expect["sha256"]:
                problems.append(f"{url}/{name}: sha256 differs from the manifest (corrupted)")
        elif items:
            table = table or _items(url, root, fs, manifest)
            if isinstance(table, str):
                problems.append(table)
            else:
                problems += _damaged_items(url, fs, path, name, table.get(name, []),
                                           expect["items_sha256"])
    return problems


def tensor_index(url: str) -> dict[str, str]:
    """Saved entries and their global shapes, from DCP's metadata (DamagedCheckpoint when
    it is not DCP's index); call only after :func:`verify` passed."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    out = {}
    for name, meta in shard_read.ShardReader(url).read_metadata().state_dict_metadata.items():
        out[name] = (f"{str(meta.properties.dtype).removeprefix('torch.')} "
                     f"{list(meta.size)}" if isinstance(meta, TensorStorageMetadata) else "bytes")
    return out


def quarantine(url: str, problems: list[str], fence: Callable[[str], None] = no_fence) -> str:
    """Moves a committed checkpoint that failed verification aside, to
    ``step-N.rejected-<unix time>`` with its reasons in REJECTED.json: it can no longer be
    resumed from or count towards retention, and nothing of it is deleted, so a person can
    look at it (and move it back if the mismatch was the verifier's). Returns its new URL.
    ``fence``: asked first, as before any write (a rank cut off from the job may not move
    the job's checkpoints)."""
    fence(f"quarantining {url}")
    write_atomic(join(url, REJECTED), json.dumps({"problems": problems}).encode())
    suffix = f".rejected-{int(time.time())}"
    fs, path = fsspec.core.url_to_fs(url)
    fs.mv(path, path.rstrip("/") + suffix, recursive=True)
    sync_dir(posixpath.dirname(url.rstrip("/")))
    return url.rstrip("/") + suffix


def remove(url: str, fence: Callable[[str], None] = no_fence) -> None:
    """Deletes a checkpoint, manifest first: interrupted, it leaves an incomplete one.
    ``fence``: asked first (a returning old coordinator may not run retention from a stale
    listing)."""
    fence(f"removing {url}")
    fs, path = fsspec.core.url_to_fs(url)
    if fs.exists(posixpath.join(path, MANIFEST)):
        fs.rm_file(posixpath.join(path, MANIFEST))
    if fs.exists(path):
        fs.rm(path, recursive=True)
