"""Hugging Face Llama format: a real checkpoint exported, loaded by transformers, and a real
2-rank run started from it (each rank reading its own slices)."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

import needs
from conftest import check, llmtrain, step_losses
from llmtrain.checkpoint import hf, storage
from llmtrain.checkpoint.shard_read import ShardReader
from llmtrain.config import ConfigError, ModelConfig, load_config
from llmtrain.data import TokenDataset, shard_urls
from llmtrain.data.sampler import GlobalSampler
from llmtrain.model import Transformer

pytestmark = pytest.mark.slow
SMALL = ("--data.embedded_max_bytes", "100000", "--metrics.prometheus", "false",
         "--metrics.log_every", "1")
DEV = "pip install -e '.[dev]'"


def transformers_agree(ckpt: str, out: Path, cfg: ModelConfig) -> Transformer:
    """Our model loaded from checkpoint ``ckpt`` and transformers' Llama from its export
    ``out`` give the same logits; returns ours."""
    transformers = needs.module("transformers", DEV)
    ours = Transformer(cfg)
    state = {f"model.{k}": v for k, v in ours.state_dict().items()}
    dcp.load(state, storage_reader=ShardReader(ckpt), no_dist=True)
    ours.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs.eval()(tokens).logits, ours(tokens),
                                   atol=1e-5, rtol=0)
    return ours


def test_export_to_transformers_and_init_from_it(tmp_path):
    needs.module("transformers", DEV)
    check(llmtrain(tmp_path / "a", "--training.steps", "2", "--checkpoint.interval_steps",
                   "2", *SMALL))
    ckpt = storage.step_dir(str(tmp_path / "a" / "checkpoints"), 2)
    out = tmp_path / "hf"
    written, no_tokenizer = hf.export(ckpt, str(out))
    assert written == ["model.safetensors", "config.json"]
    assert "data.source='embedded'" in no_tokenizer and "no tokenizer" in no_tokenizer

    cfg = load_config("debug_cpu", [("data.embedded_max_bytes", "100000")])
    ours = transformers_agree(ckpt, out, cfg.model)

    # A 2-rank run from the exported weights: its first loss is those weights' loss on
    # the first batch.
    run = tmp_path / "b"
    check(llmtrain(run, "--training.steps", "1", "--checkpoint.enable", "false",
                   "--checkpoint.init_from", str(out), *SMALL, nproc=2))
    ds = TokenDataset(shard_urls(cfg.data, str(run)), cfg.data.seq_len)
    batch = torch.stack([ds[i] for i in GlobalSampler(len(ds), cfg.training.global_batch_size,
                                                      cfg.data.seed, 0, 1).next_batch_indices()])
    with torch.no_grad():
        logits = ours(batch[:, :-1])
    expected = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    assert step_losses(run)[1] == pytest.approx(expected, rel=1e-5)


def test_init_from_names_what_does_not_match(tmp_path):
    cfg = ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=128)
    (tmp_path / "config.json").write_text(json.dumps(
        {**hf.hf_config(cfg, torch.float32), "vocab_size": 32000}))
    with pytest.raises(ConfigError, match="model.vocab_size=128 but .* has vocab_size=32000; "
                                          "set --model.vocab_size 32000"):
        hf.load(Transformer(cfg), str(tmp_path), cfg)
    (tmp_path / "config.json").write_text(json.dumps(
        {**hf.hf_config(cfg, torch.float32), "rope_scaling": {"rope_type": "llama3"}}))
    with pytest.raises(ConfigError, match="rope scaling"):
        hf.load(Transformer(cfg), str(tmp_path), cfg)
