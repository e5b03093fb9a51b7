"""Your own data end to end: ``llmtrain data prepare`` with a BPE tokenizer, then a real
``llmtrain train`` on its shards."""

import json

import pytest

from bpe import documents, train_bpe
from conftest import check, llmtrain, step_losses
from llmtrain.data.prepare import Config, prepare
from llmtrain.exit_codes import ExitCode

pytestmark = pytest.mark.slow


def test_prepare_then_train_learns(tmp_path):
    tokenizer = train_bpe(tmp_path / "tokenizer.json")
    text = tmp_path / "docs.jsonl"
    text.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(2000, 600_000)))
    out = tmp_path / "corpus"
    prepare(Config(inputs=[str(text)], tokenizer=str(tokenizer), out=str(out),
                   shard_tokens=50_000, workers=1))
    args = ("--data.source", "tokens", "--data.path", str(out), "--data.seq_len", "64",
            "--training.steps", "30", "--training.global_batch_size", "8",
            "--training.micro_batch_size", "8", "--optim.warmup_steps", "5",
            "--metrics.log_every", "1", "--checkpoint.enable", "false",
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
