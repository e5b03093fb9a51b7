"""Your own data end to end: ``llmtrain data prepare`` with a BPE tokenizer, then a real
``llmtrain train`` on its shards, then its checkpoint exported with that tokenizer."""

import json
import subprocess
import sys

import pytest

import needs
from bpe import documents, train_bpe
from conftest import ROOT, check, llmtrain, step_losses
from llmtrain.checkpoint import storage
from llmtrain.data.prepare import Config, prepare
from llmtrain.exit_codes import ExitCode

pytestmark = pytest.mark.slow


def test_prepare_then_train_learns(tmp_path):
    transformers = needs.module("transformers", "pip install -e '.[dev]'")
    tokenizer = train_bpe(tmp_path / "tokenizer.json")
    text = tmp_path / "docs.jsonl"
    text.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(2000, 600_000)))
    out = tmp_path / "corpus"
    prepare(Config(inputs=[str(text)], tokenizer=str(tokenizer), out=str(out),
                   shard_tokens=50_000, workers=1))
    args = ("--data.source", "tokens", "--data.path", str(out), "--data.seq_len", "64",
            "--training.steps", "30", "--training.global_batch_size", "8",
            "--training.micro_batch_size", "8", "--optim.warmup_steps", "5",
            "--metrics.log_every", "1", "--checkpoint.interval_steps", "30",
            "--metrics.prometheus", "false")
    run = tmp_path / "run"
    proc = llmtrain(run, *args)
    assert proc.returncode == ExitCode.FATAL, proc.stderr[-3000:]
    assert "model.vocab_size=256 is smaller than the vocabulary" in proc.stderr
    assert "(512 tokens" in proc.stderr and "at least 512" in proc.stderr

    check(llmtrain(run, *args, "--model.vocab_size", "512"))
    losses = step_losses(run)
    assert sorted(losses) == list(range(1, 31))
    assert sum(losses[s] for s in range(26, 31)) / 5 < losses[1] - 0.5, losses  # ln 512: 6.2

    # The export ships the corpus's own copy of the tokenizer (the original is gone), and
    # transformers' AutoTokenizer encodes as the tokenizer that prepared the data did.
    from tokenizers import Tokenizer
    original = Tokenizer.from_file(str(tokenizer))
    tokenizer.unlink()
    hf_dir = tmp_path / "hf"
    exported = subprocess.run(
        [sys.executable, "-m", "llmtrain", "ckpt", "export",
         storage.step_dir(str(run / "checkpoints"), 30), "--to", "hf", str(hf_dir)],
        capture_output=True, text=True, cwd=ROOT)
    assert exported.returncode == 0, exported.stderr
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in hf_dir.iterdir()}
    auto = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    text = documents(1, 2000)[0]
    assert auto(text)["input_ids"] == original.encode(text).ids
    eos = json.loads((out / "corpus.json").read_text())["tokenizer"]
    assert auto.eos_token == eos["eos"] and auto.eos_token_id == eos["eos_id"]
    assert json.loads((hf_dir / "config.json").read_text())["eos_token_id"] == eos["eos_id"]
