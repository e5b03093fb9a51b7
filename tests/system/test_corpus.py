"""The embedded corpus prepared by several real processes at once, on local disk and on an
object store, and a damaged shard ending a real run with the FATAL exit code."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, llmtrain
from llmtrain.config import DataConfig
from llmtrain.data import shard_urls
from llmtrain.exit_codes import ExitCode

# What one rank does at start-up: the shard URLs (preparing or waiting), then open them all.
RANK = """
import hashlib, json, sys
from llmtrain import data
from llmtrain.config import DataConfig
data.EMBEDDED_SHARD_TOKENS = 50_000
urls = data.shard_urls(DataConfig(source="embedded", embedded_max_bytes=300_000), sys.argv[1])
ds = data.TokenDataset(urls, seq_len=64)
tokens = b"".join(s.read(0, s.count).tobytes() for s in ds.shards)
print(json.dumps({"urls": urls, "sha256": hashlib.sha256(tokens).hexdigest()}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["local", "s3"])
def test_preparers_and_waiters_at_once(storage, request, tmp_path):
    run_dir = request.getfixturevalue("s3_url") + "/run" if storage == "s3" else str(tmp_path)
    # Two nodes' local rank 0 share the run dir and prepare; a local rank 1 waits.
    procs = [subprocess.Popen([sys.executable, "-c", RANK, run_dir], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "LOCAL_RANK": local_rank})
             for local_rank in ("0", "0", "1")]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out))
    assert all(r == results[0] for r in results)
    assert len(results[0]["urls"]) == 6  # 300_000 tokens in shards of 50_000


@pytest.mark.slow
def test_truncated_shard_is_fatal(run_dir):
    shard = shard_urls(DataConfig(embedded_max_bytes=20_000), str(run_dir))[0]
    with open(shard, "r+b") as f:
        f.truncate(1000)
    proc = llmtrain(run_dir, "--data.embedded_max_bytes", "20000")
    assert proc.returncode == ExitCode.FATAL, proc.stderr[-3000:]
    assert f"data error: shard {shard} is truncated" in proc.stderr
