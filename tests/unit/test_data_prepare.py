"""``llmtrain data prepare``: real files, a real BPE tokenizer trained here, real processes."""

import gzip
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from bpe import EOS, documents, train_bpe
from conftest import ROOT
from llmtrain.config import ConfigError, DataConfig
from llmtrain.data import ShardError, TokenDataset, check_vocab, shard_urls
from llmtrain.data.prepare import Config, PrepareError, prepare


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def expected_tokens(tokenizer, docs) -> list[int]:
    tok = Tokenizer.from_file(str(tokenizer))
    eos = tok.token_to_id(EOS)
    return [t for d in docs for t in tok.encode(d, add_special_tokens=False).ids + [eos]]


def read_tokens(out) -> list[int]:
    urls = shard_urls(DataConfig(source="tokens", path=str(out)), "unused")
    ds = TokenDataset(urls, seq_len=1)
    return [int(t) for s in ds.shards for t in s.read(0, s.count)]


def write_jsonl(path, docs, field="text", opener=open):
    with opener(path, "wt") as f:
        for d in docs:
            f.write(json.dumps({field: d, "id": 1}) + "\n")
    return str(path)


def test_jsonl_parquet_and_text(tmp_path, tokenizer):
    docs = documents(300)
    a = write_jsonl(tmp_path / "a.jsonl", docs[:100])
    b = write_jsonl(tmp_path / "b.jsonl.gz", docs[100:200], opener=gzip.open)
    pq.write_table(pa.table({"body": docs[200:], "n": list(range(100))}),
                   tmp_path / "c.parquet", row_group_size=30)
    (tmp_path / "d.txt").write_text(docs[0])

    with pytest.raises(PrepareError, match="c.parquet has no column 'text'.*--field"):
        prepare(Config(inputs=[a, b, str(tmp_path / "c.parquet")], tokenizer=str(tokenizer),
                       out=str(tmp_path / "bad"), workers=1))
    (tmp_path / "c").mkdir()
    pq.write_table(pa.table({"text": docs[200:]}), tmp_path / "c" / "c.parquet",
                   row_group_size=30)
    out = tmp_path / "out"
    manifest = prepare(Config(inputs=[a, b, str(tmp_path / "c"), str(tmp_path / "*.txt")],
                              tokenizer=str(tokenizer), out=str(out), shard_tokens=4000,
                              workers=2))
    want = expected_tokens(tokenizer, docs + [docs[0]])
    assert read_tokens(out) == want
    assert manifest["tokens"] == len(want) and manifest["documents"] == 301
    assert manifest["tokenizer"]["vocab_size"] == 512
    assert manifest["tokenizer"]["eos"] == EOS and manifest["max_token_id"] < 512
    assert len(manifest["tokenizer"]["sha256"]) == 64
    per_input = [docs[:100], docs[100:200], docs[200:], docs[:1]]
    assert [len(i["shards"]) for i in manifest["inputs"]] == [
        -(-len(expected_tokens(tokenizer, d)) // 4000) for d in per_input]
    assert all(s["tokens"] <= 4000 for s in manifest["shards"])
    assert json.loads((out / "corpus.json").read_text()) == manifest
    # The model's vocabulary must hold the tokenizer's.
    cfg = DataConfig(source="tokens", path=str(out))
    check_vocab(cfg, 512)
    with pytest.raises(ConfigError, match="model.vocab_size=256 is smaller.*512 tokens.*"
                                          "at least 512"):
        check_vocab(cfg, 256)


def test_bad_inputs_name_the_file_and_the_fix(tmp_path, tokenizer):
    def run(*inputs, **kw):
        prepare(Config(inputs=[str(p) for p in inputs], tokenizer=str(tokenizer),
                       out=str(tmp_path / "out"), workers=1, **kw))

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(PrepareError, match="bad.jsonl line 2 .*'text'.*--field"):
        run(bad)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(PrepareError, match="x.csv is not a known format"):
        run(tmp_path / "x.csv")
    with pytest.raises(PrepareError, match="nothing.jsonl' names no file"):
        run(tmp_path / "nothing.jsonl")
    with pytest.raises(PrepareError, match="no end-of-document token named '<eot>'.*--eos"):
        run(bad, eos="<eot>")


def test_killed_prepare_resumes_to_the_same_bytes(tmp_path, tokenizer):
    docs = documents(400)
    inputs = [write_jsonl(tmp_path / f"{i}.jsonl", docs[i * 100:(i + 1) * 100])
              for i in range(4)]
    args = ["data", "prepare", *inputs, "--tokenizer", str(tokenizer), "--shard-tokens",
            "3000"]
    ref = tmp_path / "ref"
    prepare(Config(inputs=inputs, tokenizer=str(tokenizer), out=str(ref), shard_tokens=3000,
                   workers=2))

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "llmtrain", *args, "--out", str(out),
                           "--workers", "1", "--faults", "kill@prepare_shard:step=6"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-3000:]
    written = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("*.bin")}
    assert len(written) == 5 and not (out / "corpus.json").exists()
    with pytest.raises(ShardError, match="has not finished.*run it again"):
        shard_urls(DataConfig(source="tokens", path=str(out)), "unused")

    prepare(Config(inputs=inputs, tokenizer=str(tokenizer), out=str(out), shard_tokens=3000,
                   workers=1))
    names = sorted(p.name for p in ref.glob("*.bin"))
    assert names == sorted(p.name for p in out.glob("*.bin")) and len(names) > 6
    for name in names:
        assert (ref / name).read_bytes() == (out / name).read_bytes(), name
    for name, stat in written.items():  # finished shards were not written again
        assert (os.stat(out / name).st_ino, os.stat(out / name).st_mtime_ns) == stat
    assert (ref / "corpus.json").read_text() == (out / "corpus.json").read_text()
    assert read_tokens(out) == expected_tokens(tokenizer, docs)

    with pytest.raises(PrepareError, match="holds a prepare with other shard_tokens"):
        prepare(Config(inputs=inputs, tokenizer=str(tokenizer), out=str(out),
                       shard_tokens=5000))
