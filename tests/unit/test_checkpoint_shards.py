"""The raw shard format (checkpoint/shard_write.py, shard_read.py, range_read.py,
in_place.py, safe_unpickle.py) through real DCP: resharding on load, the previous
(torch.save) format, plain ``dcp.load`` into an unsharded model, object stores."""

from __future__ import annotations

import ctypes
import io
import json
import os
import pickle
import subprocess
import sys

import fsspec
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.api import CheckpointException

from llmtrain.checkpoint import checksum, in_place, index, range_read, shard_write, storage
from llmtrain.checkpoint.index import RAW
from llmtrain.checkpoint.safe_unpickle import stored_object
from llmtrain.checkpoint.shard_read import (DamagedCheckpoint, ShardReader, item_sum,
                                            load_unsharded)
from ranks import spawn

# Three ranks: ranks 0-1 save a 2-way sharded state (the raw format, the dcp format, and
# main's format: DCP's stock FsspecWriter, which CommitWriter wrapped before the raw
# format), then all three load it 3-way sharded (the dcp and stock ones with DCP's stock
# reader too), and rank 0 loads it into a plain nn.Linear without any process group.
# Shard(1) makes every 3-way shard a non-contiguous part of a saved one.
def reshard_rank(rank: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{root}/store", 3), rank=rank,
                            world_size=3)
    full = {"weight": torch.randn(6, 10, generator=torch.Generator().manual_seed(0)),
            "bias": torch.arange(6.0),
            "rows": torch.arange(35, dtype=torch.bfloat16).reshape(7, 5),
            "rep": torch.arange(4.0)}
    place = {"weight": Shard(1), "bias": Shard(0), "rows": Shard(0), "rep": Replicate()}

    def sharded(mesh, zeros):
        return {k: distribute_tensor(torch.zeros_like(v) if zeros else v, mesh, [place[k]])
                for k, v in full.items()}
    mesh2, mesh3 = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [0, 1, 2])
    two = dist.new_group([0, 1])
    for fmt, make in (("new", lambda u: storage.CommitWriter(u, {"step": 1}, thread_count=2)),
                      ("dcp", lambda u: storage.CommitWriter(u, {"step": 1}, thread_count=2,
                                                             raw=False)),
                      ("old", FsspecWriter)):
        url = f"{root}/{fmt}"
        if rank < 2:
            dcp.save(sharded(mesh2, False), storage_writer=make(url), process_group=two)
        dist.barrier()
        readers = [ShardReader(url, threads=3)] + ([FsspecReader(url)] if fmt != "new" else [])
        for reader in readers:
            got = sharded(mesh3, True)
            dcp.load(got, storage_reader=reader)
            want = sharded(mesh3, False)
            for k in full:
                assert torch.equal(got[k].to_local(), want[k].to_local()), (fmt, k, rank, reader)
        if rank == 0:
            model = torch.nn.Linear(10, 6)
            sd = model.state_dict()
            dcp.load(sd, storage_reader=ShardReader(url), no_dist=True)
            model.load_state_dict(sd)
            assert torch.equal(model.weight, full["weight"]) and torch.equal(model.bias,
                                                                             full["bias"])
        dist.barrier()
    dist.destroy_process_group()  # a gloo group left to the interpreter's exit can abort there


def test_two_rank_checkpoints_of_both_formats_load_on_three_ranks_and_unsharded(tmp_path):
    spawn(reshard_rank, args=(str(tmp_path),), nprocs=3)
    for fmt in ("new", "dcp"):
        assert storage.verify(str(tmp_path / fmt), checksums=True) == []
    assert storage.read_manifest(str(tmp_path / "dcp"))["format"] == "dcp"


# What a user without llmtrain runs on a `checkpoint.format = "dcp"` checkpoint.
STOCK = """
import sys, torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
ckpt, out = sys.argv[1], sys.argv[2]
dcp_to_torch_save(ckpt, out)
state = {"w": torch.zeros(300, 70), "t": torch.zeros(4, 9)}
dcp.load(state, checkpoint_id=ckpt, no_dist=True)
torch.save(state, out + ".partial")
assert not [m for m in sys.modules if m.startswith("llmtrain")]
"""


def test_a_dcp_format_checkpoint_loads_with_stock_dcp_and_no_llmtrain(tmp_path):
    want = state()
    url = str(tmp_path / "ck")
    dcp.save(want, storage_writer=storage.CommitWriter(url, {"step": 1}, raw=False),
             no_dist=True)
    assert storage.verify(url, checksums=True) == []
    (tmp_path / "stock.py").write_text(STOCK)
    out = tmp_path / "whole.pt"
    proc = subprocess.run([sys.executable, str(tmp_path / "stock.py"), url, str(out)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    whole = torch.load(out, weights_only=False)
    assert_same(whole, want)
    partial = torch.load(str(out) + ".partial")
    assert torch.equal(partial["w"], want["w"]) and torch.equal(partial["t"], want["t"])
    # and llmtrain's own reader (what a resume uses) reads it as it reads the raw format
    got = empty_like(want)
    dcp.load(got, storage_reader=ShardReader(url), no_dist=True)
    assert_same(got, want)


def state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(300, 70, generator=g), "t": torch.randn(9, 4, generator=g).t(),
            "h": torch.randn(5, dtype=torch.float64, generator=g).to(torch.bfloat16),
            "s": torch.tensor(2.5), "e": torch.empty(0, 3), "blob": io.BytesIO(b"json")}


def empty_like(sd: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else io.BytesIO()
            for k, v in sd.items()}


def assert_same(got: dict, want: dict) -> None:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k
        else:
            assert got[k].getvalue() == v.getvalue(), k


@pytest.mark.parametrize("root", ["file", "memory://shards-test"])
def test_raw_items_round_trip_on_local_disk_and_in_batched_ranges(tmp_path, monkeypatch, root):
    """Local files go through positional reads, other storage through ``cat_ranges``
    (an object store's batched range GETs); reading pieces smaller than a tensor checks
    that the pieces are put back in place."""
    url = f"{tmp_path}/ck" if root == "file" else f"{root}/ck"
    want = state()
    dcp.save(want, storage_writer=storage.CommitWriter(url, {"step": 1}, thread_count=2),
             no_dist=True)
    assert storage.verify(url, checksums=True) == []
    reader = ShardReader(url, threads=3)
    items = reader.read_metadata().storage_data
    # every item has its sum; the tensors are raw, the BytesIO as it is
    assert all(item_sum(i) for i in items.values())
    assert sorted(RAW in i.transform_descriptors for i in items.values()) == [False] + [True] * 5
    # ITEMS.json (in the manifest, so verified) says what .metadata says, as plain data
    assert index.ITEMS in storage.read_manifest(url)["files"]
    assert reader.stored_items() == index.metadata_items(reader.read_metadata())
    assert reader.stored_items()[("h", (0,))].dtype is torch.bfloat16
    got = empty_like(want)
    monkeypatch.setattr(range_read, "READ_PIECE", 4096)
    dcp.load(got, storage_reader=reader, no_dist=True)
    assert_same(got, want)
    assert torch.equal(load_unsharded(url)["w"], want["w"])


def test_short_reads_go_on_where_they_stopped(tmp_path, monkeypatch):
    """A positional read may return fewer bytes than asked (a FUSE or NFS file can): the
    reader goes on from there, across the boundaries of the items one read fills."""
    url = str(tmp_path / "ck")
    want = state()
    dcp.save(want, storage_writer=storage.CommitWriter(url, {"step": 1}), no_dist=True)
    real, calls = range_read._preadv, []

    def short(fd, iov, count, at):  # at most 777 bytes a call, cut anywhere in a buffer
        calls.append(at)
        rows = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * count)).from_address(iov))
        cut, left = [], 777
        for base, n in rows.reshape(count, 2).tolist():
            cut.append((base, min(n, left)))
            left -= cut[-1][1]
            if not left:
                break
        cut = np.array(cut, np.uint64)
        return real(fd, cut.ctypes.data, len(cut), at)
    monkeypatch.setattr(range_read, "_preadv", short)
    got = empty_like(want)
    dcp.load(got, storage_reader=ShardReader(url), no_dist=True)
    assert_same(got, want)
    assert len(calls) > sum(v.numel() * v.element_size() for v in want.values()
                            if isinstance(v, torch.Tensor)) // 777


def test_each_reading_thread_reads_one_stretch_in_order_through_its_own_descriptors(
        tmp_path, monkeypatch):
    """The kernel reads ahead only for what looks sequential on one descriptor: each
    thread gets one stretch of the files, in order, and opens its own. (Pieces dealt out
    in turn to threads sharing descriptors read a cold checkpoint 1.5-1.9x slower.)"""
    import threading
    url = str(tmp_path / "ck")
    want = {f"t{i}": torch.full((1000,), float(i)) for i in range(24)}
    dcp.save(want, storage_writer=storage.CommitWriter(url, {"step": 1}, thread_count=2),
             no_dist=True)
    real_open, real_preadv = os.open, range_read._preadv
    owner, reads = {}, []  # descriptor: thread that opened it; (thread, fd, file, at, n)

    def opened(path, *args):
        fd = real_open(path, *args)
        owner[fd] = threading.get_ident(), os.path.basename(path)
        return fd

    def preadv(fd, iov, count, at):
        n = real_preadv(fd, iov, count, at)
        reads.append((threading.get_ident(), fd, *owner[fd], at, n))
        return n

    monkeypatch.setattr(os, "open", opened)
    monkeypatch.setattr(range_read, "_preadv", preadv)
    monkeypatch.setattr(range_read, "READ_PIECE", 4000)  # one tensor a run: many runs
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(got, storage_reader=ShardReader(url, threads=3), no_dist=True)
    assert_same(got, want)
    assert all(thread == opener for thread, _, opener, *_ in reads)
    # in file order, the reads fall into at most 3 stretches, each one thread's (a pool
    # thread that is free again may take a second stretch), read in order
    everyone = sorted((name, at, thread) for thread, _, _, name, at, _ in reads)
    order = [thread for *_, thread in everyone]
    assert len(reads) >= 24 and sum(a != b for a, b in zip(order, order[1:])) <= 2, order
    for thread in set(order):
        mine = [(name, at) for t, _, _, name, at, _ in reads if t == thread]
        assert mine == sorted(mine)


def test_local_reads_take_no_more_threads_than_the_rank_has_cpus(tmp_path, monkeypatch):
    """From the page cache a read is a copy: more reading threads than the rank's share
    of the node's CPUs only take turns on them. With one CPU a rank, every read runs
    on the loading thread itself; with more, on up to ``threads`` readers."""
    import threading
    url = str(tmp_path / "ck")
    want = {f"t{i}": torch.full((1000,), float(i)) for i in range(8)}
    dcp.save(want, storage_writer=storage.CommitWriter(url, {"step": 1}, thread_count=2),
             no_dist=True)
    real_preadv, readers = range_read._preadv, set()

    def preadv(fd, iov, count, at):
        readers.add(threading.get_ident())
        return real_preadv(fd, iov, count, at)

    monkeypatch.setattr(range_read, "_preadv", preadv)
    monkeypatch.setattr(range_read, "READ_PIECE", 4000)  # one tensor a run: many runs
    for cpus, expected in ((1, {threading.get_ident()}), (64, None)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        readers.clear()
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load(got, storage_reader=ShardReader(url, threads=4), no_dist=True)
        assert_same(got, want)
        if expected is not None:
            assert readers == expected
        else:
            assert readers and threading.get_ident() not in readers  # the pool's readers


def test_stock_readers_refuse_the_raw_format_instead_of_misreading_it(tmp_path):
    url = str(tmp_path / "ck")
    dcp.save({"w": torch.ones(4)}, storage_writer=storage.CommitWriter(url, {"step": 1}),
             no_dist=True)
    with pytest.raises(BaseException, match="llmtrain-raw"):
        dcp.load({"w": torch.zeros(4)}, storage_reader=FsspecReader(url), no_dist=True)


def test_a_truncated_shard_fails_the_load(tmp_path):
    url = str(tmp_path / "ck")
    dcp.save({"w": torch.ones(1000)}, storage_writer=storage.CommitWriter(url, {"step": 1}),
             no_dist=True)
    shard = next(tmp_path.glob("ck/*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(BaseException, match="truncated"):
        dcp.load({"w": torch.zeros(1000)}, storage_reader=ShardReader(url), no_dist=True)


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])  # sha256: checkpoints before
def test_a_flipped_byte_is_named_by_its_item_when_verified_and_when_read_in_place(
        tmp_path, monkeypatch, algorithm):
    """Item sums: ``verify`` names the damaged item, and an in-place read that checks its
    items raises before returning anything, naming the same one; unchecked it reads."""
    monkeypatch.setattr(checksum, "DEFAULT", algorithm)
    url = str(tmp_path / "ck")
    want = state()
    dcp.save(want, storage_writer=storage.CommitWriter(url, {"step": 1}, thread_count=1),
             no_dist=True)
    info = next(i for k, i in ShardReader(url).read_metadata().storage_data.items()
                if k.fqn == "w")
    shard = tmp_path / "ck" / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + 1234] ^= 0x10
    shard.write_bytes(bytes(data))
    (problem,) = storage.verify(url, checksums=True)
    assert item_sum(info)[0] == algorithm
    assert f"{info.relative_path}: {algorithm} differs from the manifest in w " in problem
    assert storage.verify(url, checksums=True, items=False) == []  # left to the reader
    assert storage.verify(url, checksums=True, whole=False) == [problem]  # items only

    tensors = {(k, (0,) * v.ndim): torch.zeros(v.shape, dtype=v.dtype)
               for k, v in want.items() if isinstance(v, torch.Tensor)}
    reader = ShardReader(url)
    plan = in_place.plan_in_place(reader, in_place.LiveShards(tensors), ["blob"])
    assert plan.checked
    with pytest.raises(DamagedCheckpoint) as damaged:
        in_place.read_in_place(reader, plan, check=True)
    assert [p.split("/")[-1] for p in damaged.value.problems] == [
        problem.split("/")[-1]]
    assert list(in_place.read_objects(reader, plan, check=True)) == ["blob"]
    in_place.read_in_place(reader, plan)
    assert not torch.equal(tensors[("w", (0, 0))], want["w"])

    # a damaged object is named by the read that checks the objects, before any tensor
    blob = next(i for k, i in reader.read_metadata().storage_data.items() if k.fqn == "blob")
    data = bytearray((tmp_path / "ck" / blob.relative_path).read_bytes())
    data[blob.offset + blob.length - 1] ^= 0x01
    (tmp_path / "ck" / blob.relative_path).write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpoint) as damaged:
        in_place.read_objects(ShardReader(url), plan, check=True)
    assert [p.split("/")[-1] for p in damaged.value.problems] == [
        f"{blob.relative_path}: {algorithm} differs from the manifest in blob (bytes "
        f"{blob.offset}-{blob.offset + blob.length}; corrupted)"]
    assert in_place.read_objects(reader, plan)["blob"] == bytes(
        data[blob.offset:blob.offset + blob.length])
    assert torch.equal(tensors[("t", (0, 0))], want["t"])


class _RunsCode:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_stored_objects_decode_as_torch_load_does_and_never_run_code(tmp_path, monkeypatch):
    """Small items (DCP's torch.save archives) are read by a plain-values unpickler,
    without torch.load; an RNG state's tensors go to torch.load(weights_only=True); a
    pickle that would call anything else is refused by both and runs nothing."""
    def stored(obj) -> bytes:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()

    plain = [1e-3, (0.9, 0.95), False, None, 7, "x", {"a": [1, 2.5]}, b"\x00\xff",
             io.BytesIO(b'{"step": 3}')]
    archives = [stored(value) for value in plain]
    with monkeypatch.context() as m:
        m.setattr(torch, "load", None)  # the plain values never need it
        got = [stored_object(a) for a in archives]
    assert got[:-1] == plain[:-1] and got[-1].getvalue() == b'{"step": 3}'
    rng = stored_object(stored({"torch": torch.get_rng_state()}))
    assert torch.equal(rng["torch"], torch.get_rng_state())
    planted = tmp_path / "ran"
    with pytest.raises(Exception, match="system|Unsupported|not allowed|global"):
        stored_object(stored(_RunsCode(planted)))
    assert not planted.exists()


def test_planned_loads_read_the_index_and_objects_as_plain_data_and_never_run_code(tmp_path):
    """What DCP itself unpickles with ``pickle.load`` (``.metadata``) and
    ``torch.load(weights_only=False)`` (every stored object), a load llmtrain has DCP plan
    (a resharding or dcp-format resume, ``load_unsharded``) reads through unpicklers of
    DCP's index and of plain values: a dcp-format checkpoint loads as before, and a pickle
    that would call anything else, in either place, is refused and runs nothing."""
    url, planted = str(tmp_path / "ck"), tmp_path / "ran"
    want = {"w": torch.arange(4.0), "b": torch.ones(2, dtype=torch.bfloat16), "lr": 1e-3,
            "betas": (0.9, 0.95)}
    dcp.save(want, storage_writer=storage.CommitWriter(url, {"step": 1}, raw=False),
             no_dist=True)
    stock = str(tmp_path / "stock")  # DCP's own writer, which records its path
    dcp.save(want, storage_writer=dcp.FileSystemWriter(stock), no_dist=True)
    for saved in (url, stock):
        got = load_unsharded(saved)
        assert got["lr"] == 1e-3 and got["betas"] == (0.9, 0.95)
        assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])

    evil = str(tmp_path / "evil")
    dcp.save({**want, "lr": _RunsCode(planted)}, no_dist=True,
             storage_writer=storage.CommitWriter(evil, {"step": 1}, raw=False))
    with pytest.raises(CheckpointException, match="posix.system"):  # DCP's, around the refusal
        load_unsharded(evil)
    with open(os.path.join(url, ".metadata"), "wb") as f:
        f.write(pickle.dumps(_RunsCode(planted)))
    with pytest.raises(DamagedCheckpoint, match="not DCP's index.*posix.system"):
        ShardReader(url).read_metadata()
    assert not planted.exists()


@pytest.mark.parametrize("one_thread", [False, True])
def test_writer_threads_run_nicer_than_the_training_thread(tmp_path, monkeypatch, one_thread):
    """A background save's write threads get checkpoint.writer_nice added to their own
    niceness once, however many files each writes (a pool thread that finishes its file
    first takes the next one: forced here with one thread); the training thread keeps its
    priority."""
    import os
    import threading
    from concurrent.futures import ThreadPoolExecutor
    seen = []
    real = shard_write.tensor_bytes

    def recording(tensor):  # the niceness of the thread writing each tensor
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real(tensor)

    class OneThread(ThreadPoolExecutor):
        def __init__(self, max_workers=None, **kwargs):
            super().__init__(max_workers=1, **kwargs)

    monkeypatch.setattr(shard_write, "tensor_bytes", recording)
    if one_thread:
        monkeypatch.setattr(shard_write, "ThreadPoolExecutor", OneThread)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    dcp.save(state(), storage_writer=storage.CommitWriter(str(tmp_path / "ck"), {"step": 1},
                                                          thread_count=2, nice=5),
             no_dist=True)
    assert len(list((tmp_path / "ck").glob("*.distcp"))) == 2
    assert len(seen) > 1 and all(n == min(19, mine + 5) for n in seen), (mine, seen)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    assert storage.verify(str(tmp_path / "ck"), checksums=True) == []


@pytest.mark.parametrize("fs,layout", [("local", "columns"), ("memory", "columns"),
                                       ("local", "rows")])
def test_each_rank_reads_only_its_own_sections_of_the_index(tmp_path, monkeypatch, fs, layout):
    """INDEX2.bin gives each rank of the saved world size the items of its own state (a
    replicated item in every rank's, whoever wrote it), read from its sections alone;
    ranks holding the same items share a section; another world size gets every item; a
    damaged section is refused. Raw tensor chunks with an XXH3 sum are kept in columns,
    other items in rows; an index written before columns (INDEX.bin, JSON rows) reads the
    same."""
    root = str(tmp_path) if fs == "local" else f"memory://{tmp_path}"
    # 4 ranks, 2 replicas of 2 shards (HSDP): ranks r and r + 2 hold the same chunk
    summed = [RAW, checksum.label("ab" * 16)]
    items = {("w", (r * 4, 0)): index.StoredItem(f"__{r}_0.distcp", 0, 64, summed, (4, 4),
                                                  torch.float32) for r in range(2)}
    items |= {("v", (r * 2,)): index.StoredItem(f"__{r}_1.distcp", 0, 8, [RAW], (2,),
                                                 torch.bfloat16) for r in range(4)}
    items |= {(f"rng.{r}", None): index.StoredItem(f"__{r}_0.distcp", 64, 9, [], None, None)
              for r in range(4)}
    items[("trainer", None)] = index.StoredItem("__3_0.distcp", 73, 9, [], None, None)
    needs = [[("w", (r % 2 * 4, 0)), ("v", (r * 2,)), (f"rng.{r}", None), ("trainer", None)]
             for r in range(4)]
    stream = io.BytesIO()
    with monkeypatch.context() as m:
        if layout == "rows":  # as written before columns: INDEX.bin, JSON rows, LLMIDX01
            m.setattr(index, "MAGIC", index.MAGIC_ROWS)
            m.setattr(index, "_section_bytes", lambda body, items, keys: json.dumps(
                {**body, "items": index._rows({k: items[k] for k in keys})}).encode())
        index.write_index(stream, items, index.index_layout(needs))
    data = stream.getvalue()
    name = index.INDEX if layout == "columns" else index.INDEX_ROWS
    with fsspec.open(f"{root}/{name}", "wb") as f:
        f.write(data)
    with fsspec.open(f"{root}/{index.ITEMS}", "wb") as f:
        f.write(index.items_json(items))
    entries = [index.entry(data, r, 4) for r in range(4)]
    assert entries[0][:3] == entries[2][:3] != entries[1][:3] == entries[3][:3]
    for rank in range(4):
        reader = ShardReader(root, rank=rank, world=4)
        assert reader.own_items() == {key: items[key] for key in needs[rank]}
        assert reader.has_own_section() and reader._items is None  # ITEMS.json unread
        section = reader.own_section()
        if layout == "columns":  # w in columns; v (no sum) and the objects in rows
            w = items[("w", (rank % 2 * 4, 0))]
            assert section.lines == [index.key_line("w", (rank % 2 * 4, 0), (4, 4),
                                                    torch.float32)]
            assert section.files[section.file[0]] == w.relative_path
            assert section.digests == bytes.fromhex("ab" * 16)
        assert sorted(section.rows) == sorted(needs[rank][layout == "columns":])
    assert ShardReader(root, rank=0, world=3).own_items() == items  # resharding: every item
    assert not ShardReader(root, rank=0, world=8).has_own_section()
    offset, length = entries[1][3:5]  # rank 1's own section
    damaged = bytearray(data)
    damaged[offset + length // 2] ^= 0x04
    with fsspec.open(f"{root}/{name}", "wb") as f:
        f.write(bytes(damaged))
    assert ShardReader(root, rank=0, world=4).has_own_section()
    with pytest.raises(DamagedCheckpoint, match="a section of rank 1's entry differs"):
        ShardReader(root, rank=1, world=4).own_items()


def test_index_rows_name_only_torch_dtypes():
    """A row's dtype is looked up by name on ``torch``: a name of anything but a dtype (a
    function, a module) is refused, naming the file, rather than used."""
    row = ["w", [0, 0], "__0_0.distcp", 0, 64, [RAW], [4, 4]]
    items = index.parse_rows([[*row, "bfloat16"], ["n", None, "__0_0.distcp", 64, 9, [],
                                                       None, None]], "ITEMS.json")
    assert items[("w", (0, 0))].dtype is torch.bfloat16 and items[("w", (0, 0))].sizes == (4, 4)
    assert items[("n", None)] == index.StoredItem("__0_0.distcp", 64, 9, [], None, None)
    for name in ("save", "nn", "not_a_dtype"):
        with pytest.raises(ValueError, match=f"ITEMS.json: '{name}' is not a torch dtype"):
            index.parse_rows([[*row, name]], "ITEMS.json")


def test_a_reader_given_another_checkpoint_by_dcp_reads_that_one(tmp_path):
    """``dcp.load(..., checkpoint_id=B, storage_reader=reader of A)``: DCP resets the reader
    to B, and every read (the metadata, the index, the bytes) is B's, not A's."""
    urls = {}
    for name, scale in (("a", 1.0), ("b", -3.0)):
        sd = state()
        sd["w"].mul_(scale)
        urls[name] = (str(tmp_path / name), sd)
        dcp.save(sd, storage_writer=storage.CommitWriter(urls[name][0], {"step": 1}),
                 no_dist=True)
    reader = ShardReader(urls["a"][0])
    assert reader.stored_items()  # A's index read before the reset
    got = empty_like(urls["b"][1])
    dcp.load(got, checkpoint_id=urls["b"][0], storage_reader=reader, no_dist=True)
    assert_same(got, urls["b"][1])
