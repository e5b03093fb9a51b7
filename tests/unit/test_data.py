import json
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import fsspec
import numpy as np
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from llmtrain import data
from llmtrain.config import ConfigError, DataConfig
from llmtrain.data import (ByteTokenizer, ShardError, TokenDataset, prepare_embedded_corpus,
                           shard_urls, write_shard)
from llmtrain.data.sampler import BatchIterator, FeistelPermutation, GlobalSampler


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo ✓'\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < tok.vocab_size == 256
    assert tok.decode(ids) == text
    assert tok.eos_id == 0 and tok.eos_id not in ids
    assert tok.decode([0xFF]) == "\ufffd"


@pytest.mark.parametrize("high, itemsize", [(65535, 2), (70000, 4)])
def test_shard_round_trip(tmp_path, high, itemsize):
    tokens = np.random.default_rng(0).integers(0, high + 1, size=1001)
    tokens[0] = high
    url = str(tmp_path / "s.bin")
    write_shard(url, tokens)
    raw = open(url, "rb").read()
    assert raw[:8] == b"LLMTOK01" and len(raw) == 32 + 1001 * itemsize
    assert int.from_bytes(raw[8:12], "little") == itemsize
    assert int.from_bytes(raw[16:24], "little") == 1001
    assert not [p for p in os.listdir(tmp_path) if p != "s.bin"]  # temp file renamed away

    ds = TokenDataset([url], seq_len=10)
    assert len(ds) == 100
    for j in (0, 57, 99):
        assert ds[j].dtype == torch.int64
        assert ds[j].tolist() == tokens[j * 10:j * 10 + 11].tolist()
    with pytest.raises(IndexError):
        ds[100]


def test_samples_do_not_cross_shards(tmp_path):
    a, b = np.arange(10), np.arange(100, 107)
    write_shard(str(tmp_path / "a.bin"), a)
    write_shard(str(tmp_path / "b.bin"), b)
    write_shard(str(tmp_path / "c.bin"), np.arange(3))  # too short for a sample
    ds = TokenDataset([str(tmp_path / n) for n in ("a.bin", "c.bin", "b.bin")], seq_len=3)
    assert len(ds) == 9 // 3 + 6 // 3
    assert ds[2].tolist() == [6, 7, 8, 9]
    assert ds[3].tolist() == [100, 101, 102, 103]
    assert ds[4].tolist() == [103, 104, 105, 106]


def test_truncated_shard(tmp_path):
    url = str(tmp_path / "cut.bin")
    write_shard(url, np.arange(1000))
    with open(url, "r+b") as f:
        f.truncate(1500)
    with pytest.raises(ShardError, match="truncated") as e:
        TokenDataset([url], seq_len=8)
    msg = str(e.value)
    assert "cut.bin" in msg and "1000 tokens (2032 bytes)" in msg and "1500 bytes" in msg
    with open(url, "r+b") as f:
        f.truncate(20)  # not even a whole header
    with pytest.raises(ShardError, match="cut.bin.*truncated"):
        TokenDataset([url], seq_len=8)


def test_shard_cut_after_its_size_was_read(tmp_path, monkeypatch):
    url = str(tmp_path / "cut.bin")
    write_shard(url, np.arange(1000))
    with open(url, "r+b") as f:
        f.truncate(20)
    monkeypatch.setattr(LocalFileSystem, "size", lambda self, path: 2032)
    with pytest.raises(ShardError, match="cut.bin is truncated.*header gave 20 bytes"):
        TokenDataset([url], seq_len=8)


def test_bad_magic(tmp_path):
    url = str(tmp_path / "bad.bin")
    write_shard(url, np.arange(100))
    with open(url, "r+b") as f:
        f.write(b"NOTTOKEN")
    with pytest.raises(ShardError, match="bad.bin.*NOTTOKEN"):
        TokenDataset([url], seq_len=8)


def test_too_short_for_any_sample(tmp_path):
    write_shard(str(tmp_path / "s.bin"), np.arange(8))
    with pytest.raises(ShardError, match="seq_len\\+1 = 9"):
        TokenDataset([str(tmp_path / "s.bin")], seq_len=8)


def test_shard_urls_tokens(tmp_path):
    for name in ("b.bin", "a.bin"):
        write_shard(str(tmp_path / name), np.arange(50))
    (tmp_path / "notes.txt").write_text("not a shard")
    cfg = DataConfig(source="tokens", path=str(tmp_path))
    assert shard_urls(cfg, "unused") == [f"{tmp_path}/a.bin", f"{tmp_path}/b.bin"]

    missing = DataConfig(source="tokens", path=str(tmp_path / "nope"))
    with pytest.raises(ShardError, match="data.path.*nope"):
        shard_urls(missing, "unused")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardError, match="data.path.*no \\*.bin"):
        shard_urls(DataConfig(source="tokens", path=str(tmp_path / "empty")), "unused")


def test_memory_filesystem_matches_local(tmp_path):
    root = f"memory://shards-{uuid.uuid4().hex}"
    shards = [np.random.default_rng(i).integers(0, 70000 if i else 500, size=n)
              for i, n in enumerate((300, 171))]
    try:
        for i, tokens in enumerate(shards):
            write_shard(f"{root}/{i}.bin", tokens)
            write_shard(str(tmp_path / f"{i}.bin"), tokens)
        urls = shard_urls(DataConfig(source="tokens", path=root), "unused")
        assert urls == [f"{root}/0.bin", f"{root}/1.bin"]
        remote = TokenDataset(urls, seq_len=16)
        assert all(s.memmap is None for s in remote.shards)  # range reads, not memmap
        local = TokenDataset([str(tmp_path / "0.bin"), str(tmp_path / "1.bin")], 16)
        assert all(s.memmap is not None for s in local.shards)
        assert len(remote) == len(local) == 299 // 16 + 170 // 16
        for i in range(len(local)):
            assert torch.equal(remote[i], local[i])
    finally:
        fsspec.filesystem("memory").rm(root, recursive=True)


def _global_steps(world, steps, num_samples=10, batch=4, seed=3, state=None):
    """Per step, the concatenation over ranks of each rank's indices."""
    samplers = [GlobalSampler(num_samples, batch, seed, r, world) for r in range(world)]
    if state is not None:
        for s in samplers:
            s.load_state_dict(state)
    return [sum((s.next_batch_indices() for s in samplers), []) for _ in range(steps)]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 4097])
def test_feistel_is_a_bijection(n):
    perm = FeistelPermutation(n, b"k")
    image = perm(np.arange(n))
    assert image.dtype == np.uint64
    assert sorted(image.tolist()) == list(range(n))
    if n >= 16:  # a shuffle, not the identity or a rotation
        assert (image != np.arange(n)).mean() > 0.8
        assert len(set((image - np.arange(n, dtype=np.uint64)).tolist())) > n // 2


def test_feistel_keys_give_different_orders():
    orders = [FeistelPermutation(1000, k)(np.arange(1000)).tolist()
              for k in (b"a", b"b", b"c")]
    assert orders[0] != orders[1] != orders[2] != orders[0]
    assert orders[0] == FeistelPermutation(1000, b"a")(np.arange(1000)).tolist()


def test_sampler_order_independent_of_world_size():
    ref = _global_steps(1, 12)  # 48 samples over 10: steps straddle epoch boundaries
    assert _global_steps(2, 12) == ref and _global_steps(4, 12) == ref
    flat = sum(ref, [])
    for e in range(4):
        assert sorted(flat[e * 10:(e + 1) * 10]) == list(range(10))
    big = _global_steps(1, 5, num_samples=1001, batch=240, seed=7)
    assert _global_steps(8, 5, num_samples=1001, batch=240, seed=7) == big
    assert _global_steps(3, 5, num_samples=1001, batch=240, seed=7) == big


def test_sampler_epochs_and_seeds_give_new_orders():
    s = GlobalSampler(50, 50, seed=0, dp_rank=0, dp_world=1)
    e0, e1 = s.next_batch_indices(), s.next_batch_indices()
    assert sorted(e0) == sorted(e1) == list(range(50)) and e0 != e1
    other = GlobalSampler(50, 50, seed=1, dp_rank=0, dp_world=1).next_batch_indices()
    assert sorted(other) == list(range(50)) and other not in (e0, e1)


def test_sampler_memory_does_not_grow_with_the_data():
    s = GlobalSampler(10**12, 8, seed=0, dp_rank=0, dp_world=1)
    s.load_state_dict({**s.state_dict(), "consumed_samples": 3 * 10**12 + 5})
    indices = s.next_batch_indices()  # a permutation would need 8 TB
    assert len(set(indices)) == 8 and all(0 <= i < 10**12 for i in indices)
    assert s.permutation(3).keys.nbytes == 8 * 6


def test_sampler_resume_across_world_sizes():
    ref = _global_steps(1, 10)
    samplers = [GlobalSampler(10, 4, 3, r, 2) for r in range(2)]
    for _ in range(3):
        for s in samplers:
            s.next_batch_indices()
    state = samplers[1].state_dict()
    assert state == {"consumed_samples": 12, "seed": 3, "num_samples": 10,
                     "order": "feistel-v1"}
    assert _global_steps(4, 7, state=state) == ref[3:]
    assert _global_steps(1, 7, state=state) == ref[3:]


def test_sampler_rejects_changed_data_and_bad_batch():
    state = GlobalSampler(10, 4, 3, 0, 1).state_dict()
    for other in (GlobalSampler(11, 4, 3, 0, 1), GlobalSampler(10, 4, 4, 0, 1)):
        with pytest.raises(ConfigError, match="the data changed since the checkpoint"):
            other.load_state_dict(state)
    with pytest.raises(ValueError, match="not divisible by 3"):
        GlobalSampler(10, 4, 0, 0, 3)


def test_sampler_state_of_the_stored_permutation():
    """The old sampler's state resumes at an epoch boundary, and mid-epoch fails saying
    why and what to do."""
    old = {"consumed_samples": 20, "seed": 3, "num_samples": 10}  # no "order"
    s = GlobalSampler(10, 4, 3, 0, 1)
    s.load_state_dict(old)
    assert s.next_batch_indices() == _global_steps(1, 6)[5]
    with pytest.raises(ConfigError, match="global sample 12, 2 samples into epoch 1.*stored "
                                          "permutation.*feistel-v1.*repeat.*multiple of 10"):
        s.load_state_dict({**old, "consumed_samples": 12})


def test_batch_iterator(tmp_path):
    write_shard(str(tmp_path / "s.bin"), np.arange(1000))
    ds = TokenDataset([str(tmp_path / "s.bin")], seq_len=16)
    it = BatchIterator(ds, GlobalSampler(len(ds), 8, 0, dp_rank=1, dp_world=2), 2)
    expected = GlobalSampler(len(ds), 8, 0, dp_rank=1, dp_world=2).next_batch_indices()
    batches = it.next_step()
    assert len(batches) == 2
    rows = []
    for inputs, targets in batches:
        assert inputs.shape == targets.shape == (2, 16)
        assert inputs.dtype == targets.dtype == torch.int64
        assert torch.equal(targets, inputs + 1)  # arange tokens: shifted by one
        rows += inputs[:, 0].tolist()
    assert rows == [ds[i][0].item() for i in expected]
    assert it.state_dict()["consumed_samples"] == 8
    with pytest.raises(ValueError, match="micro-batches of 3"):
        BatchIterator(ds, GlobalSampler(len(ds), 8, 0, 0, 2), 3)


def test_embedded_corpus(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "EMBEDDED_SHARD_TOKENS", 40_000)
    urls = prepare_embedded_corpus(str(tmp_path / "a"), 100_000)
    assert [os.path.basename(u) for u in urls] == [
        "embedded-00000.bin", "embedded-00001.bin", "embedded-00002.bin"]
    manifest = json.loads((tmp_path / "a" / "corpus.json").read_text())
    assert manifest["max_bytes"] == 100_000
    assert [s["tokens"] for s in manifest["shards"]] == [40_000, 40_000, 20_000]

    ds = TokenDataset(urls, seq_len=99)
    tokens = torch.cat([ds[i] for i in range(len(ds))])
    assert int(tokens.max()) < 256 and (tokens == 0).any()  # EOS between files
    assert "import " in ByteTokenizer().decode(tokens.tolist())  # real Python source

    # Another directory builds the same bytes; a second call in the same one reuses them.
    again = prepare_embedded_corpus(str(tmp_path / "b"), 100_000)
    assert json.loads((tmp_path / "b" / "corpus.json").read_text())["sha256"] == \
        manifest["sha256"]
    assert [open(u, "rb").read() for u in again] == [open(u, "rb").read() for u in urls]

    def no_rebuild(_):
        raise AssertionError("rebuilt an existing corpus")
    monkeypatch.setattr(data, "_stdlib_bytes", no_rebuild)
    assert prepare_embedded_corpus(str(tmp_path / "a"), 100_000) == urls
    with pytest.raises(AssertionError, match="rebuilt"):  # a new size does rebuild
        prepare_embedded_corpus(str(tmp_path / "a"), 50_000)


def test_embedded_corpus_concurrent_callers(tmp_path):
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: prepare_embedded_corpus(str(tmp_path), 60_000),
                                range(4)))
    assert all(r == results[0] for r in results)
    assert sorted(os.listdir(tmp_path)) == ["corpus.json", "embedded-00000.bin"]
    assert len(TokenDataset(results[0], seq_len=64)) == 59_999 // 64


def test_embedded_corpus_waiters_wait_for_the_marker(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "EMBEDDED_SHARD_TOKENS", 40_000)
    # A preparer half-way through its first shard (as a non-atomic storage shows it).
    (tmp_path / "embedded-00000.bin").write_bytes(b"LLMTOK01" + bytes(10))
    with pytest.raises(TimeoutError, match=f"{tmp_path}/corpus.json.*local rank 0"):
        prepare_embedded_corpus(str(tmp_path), 100_000, preparer=False, wait_s=0.2)

    def waiter():  # opens the shards as soon as it is told they are there
        return TokenDataset(prepare_embedded_corpus(str(tmp_path), 100_000, preparer=False),
                            seq_len=99)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(waiter)
        time.sleep(1.0)
        assert not waiting.done()
        urls = prepare_embedded_corpus(str(tmp_path), 100_000)
        ds = waiting.result(timeout=30)  # the partial shard would have raised ShardError
    assert [s.url for s in ds.shards] == urls and len(ds) == len(TokenDataset(urls, 99))
    with pytest.raises(TimeoutError):  # a marker for another size commits nothing
        prepare_embedded_corpus(str(tmp_path), 50_000, preparer=False, wait_s=0.2)


def test_shard_urls_embedded(tmp_path, monkeypatch):
    cfg = DataConfig(source="embedded", embedded_max_bytes=20_000)
    monkeypatch.setenv("LOCAL_RANK", "0")
    urls = shard_urls(cfg, str(tmp_path))
    assert urls == [f"{tmp_path}/data/embedded/embedded-00000.bin"]
    assert len(TokenDataset(urls, 100)) == 19_999 // 100
    monkeypatch.setenv("LOCAL_RANK", "1")  # waits for local rank 0's corpus, writes nothing
    monkeypatch.setattr(data, "write_atomic", None)
    assert shard_urls(cfg, str(tmp_path)) == urls


def test_prefetch_gives_the_same_batches_and_follows_the_position(tmp_path):
    write_shard(str(tmp_path / "s.bin"), np.arange(5000))
    ds = TokenDataset([str(tmp_path / "s.bin")], seq_len=16)

    def iterator(prefetch):
        return BatchIterator(ds, GlobalSampler(len(ds), 8, 0, 1, 2), 2, prefetch=prefetch)
    plain, ahead = iterator(0), iterator(3)
    try:
        for _ in range(5):
            for (a, b), (c, d) in zip(plain.next_step(), ahead.next_step()):
                assert torch.equal(a, c) and torch.equal(b, d)
        assert sorted(ahead._ahead) == [40 + 8 * k for k in range(3)]  # read ahead
        assert ahead.state_dict() == plain.state_dict()  # batches handed out, not read
        state = ahead.state_dict()
        ahead.load_state_dict({**state, "consumed_samples": 16})  # a rollback
        plain.load_state_dict({**state, "consumed_samples": 16})
        assert [torch.equal(a, c) for (a, _), (c, _) in
                zip(plain.next_step(), ahead.next_step())] == [True, True]
        assert sorted(ahead._ahead) == [24 + 8 * k for k in range(3)]
    finally:
        ahead.close()
