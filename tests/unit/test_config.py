import json
import subprocess
import sys

import pytest

from llmtrain.cli import main
from llmtrain.config import ConfigError, load_config, parse_overrides, preset_names
from llmtrain.exit_codes import ExitCode
from llmtrain.model import count_params


def load(*args: str, preset: str = "debug_cpu"):
    return load_config(preset, parse_overrides(list(args)))


def test_presets_load_with_published_llama3_shapes():
    assert {"debug_cpu", "llama3_8b", "llama3_70b", "llama3_405b"} <= set(preset_names())
    sizes = {"llama3_8b": 8.03e9, "llama3_70b": 70.55e9, "llama3_405b": 405.9e9}
    for name, params in sizes.items():
        cfg = load("--data.path", "memory://tokens", preset=name)
        cfg.validate(world_size=64)
        assert cfg.model.vocab_size == 128256 and cfg.model.n_kv_heads == 8
        assert count_params(cfg.model) == pytest.approx(params, rel=1e-3)


def test_overrides_in_both_forms_and_types():
    cfg = load("--optim.lr", "1e-4", "--training.steps=7", "--model.tie_embeddings", "true",
               "--parallelism.fp8", "rowwise")
    assert cfg.optim.lr == 1e-4 and cfg.training.steps == 7
    assert cfg.model.tie_embeddings is True and cfg.parallelism.fp8 == "rowwise"


@pytest.mark.parametrize("args, words", [
    (["--optim.lrr", "1"], ["'optim.lrr'", "did you mean 'optim.lr'"]),
    (["--nosuch.field", "1"], ["'nosuch.field'", "valid keys"]),
    (["--checkpoint.vote_interval_s", "2"], ["moved to 'control.vote_interval_s'"]),
    (["--training.steps", "ten"], ["'training.steps'", "an integer", "'ten'"]),
    (["--optim.lr", "nan"], ["'optim.lr'", "finite number"]),
    (["--model.tie_embeddings", "maybe"], ["'model.tie_embeddings'", "true or false"]),
    (["--optim.lr", "-1"], ["'optim.lr'", "-1.0", "out of range", "> 0"]),
    (["--optim.beta2", "1.0"], ["'optim.beta2'", "< 1"]),
    (["--parallelism.fp8", "fp4"], ["'parallelism.fp8'", "'fp4'", "'tensorwise'"]),
    (["--data.seq_len", "0"], ["'data.seq_len'", ">= 1"]),
    (["--optim.lr"], ["has no value"]),
    (["optim.lr=1"], ["--section.field"]),
])
def test_bad_field_names_the_field_value_and_allowed(args, words):
    with pytest.raises(ConfigError) as e:
        load(*args)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("args, world, words", [
    (["--model.n_heads", "3"], 1, ["model.dim=128", "model.n_heads=3"]),
    (["--model.n_kv_heads", "3"], 1, ["model.n_kv_heads=3", "divide"]),
    (["--data.seq_len", "512"], 1, ["data.seq_len=512", "model.max_seq_len=256"]),
    (["--data.source", "tokens"], 1, ["data.path", "empty"]),
    (["--training.global_batch_size", "12"], 2, ["global_batch_size=12", "16"]),
    (["--parallelism.dp_replicate", "3"], 2, ["dp_replicate=3", "2 ranks"]),
    (["--parallelism.dp_replicate", "-1"], 2, ["dp_shard=-1", "at most one of them -1"]),
    (["--parallelism.dp_replicate", "0"], 2, ["dp_replicate=0", "a count of ranks"]),
    (["--parallelism.dp_replicate", "-1", "--parallelism.dp_shard", "2"], 3,
     ["dp_shard=2", "3 ranks"]),
    (["--model.vocab_size", "100"], 1, ["model.vocab_size=100", ">= 256"]),
])
def test_inconsistent_fields_fail_validation(args, world, words):
    cfg = load(*args)
    with pytest.raises(ConfigError) as e:
        cfg.validate(world)
    for w in words:
        assert w in str(e.value)


def test_replicas_of_a_fixed_size_fit_any_multiple_of_it():
    """dp_replicate -1: the job gains and loses whole replicas of dp_shard ranks (an
    elastic HSDP job that shrinks by a replica keeps every other replica as it was)."""
    cfg = load("--parallelism.dp_replicate", "-1", "--parallelism.dp_shard", "2")
    assert [cfg.mesh_shape(w) for w in (2, 4, 6)] == [(1, 2), (2, 2), (3, 2)]
    fixed = load("--parallelism.dp_replicate", "2")
    assert [fixed.mesh_shape(w) for w in (2, 4)] == [(2, 1), (2, 2)]


def test_accumulation_keeps_global_batch():
    cfg = load("--training.global_batch_size", "32", "--training.micro_batch_size", "4")
    assert [cfg.accumulation_steps(w) for w in (1, 2, 4, 8)] == [8, 4, 2, 1]


def test_toml_file_and_its_errors(tmp_path):
    good = tmp_path / "run.toml"
    good.write_text('[optim]\nlr = 1e-3\n[training]\nsteps = 3\n')
    assert load_config(str(good)).training.steps == 3
    bad = tmp_path / "bad.toml"
    bad.write_text('[optim]\nlr = "fast"\n')
    with pytest.raises(ConfigError, match="'optim.lr' expects a finite number"):
        load_config(str(bad))
    broken = tmp_path / "broken.toml"
    broken.write_text("[optim\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(broken))
    with pytest.raises(ConfigError, match="unknown preset 'llama9'"):
        load_config("llama9")


def test_cli_config_error_is_fatal_before_any_process_group(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "llmtrain", "train", "--optim.warmup_steps", "-5",
         "--training.run_dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == ExitCode.FATAL
    assert "optim.warmup_steps" in proc.stderr and ">= 0" in proc.stderr
    assert not (tmp_path / "run").exists()  # failed before touching anything


def test_unwritable_checkpoint_storage_is_fatal_before_training(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "llmtrain", "train", "--training.run_dir", str(tmp_path / "run"),
         "--checkpoint.url", "/proc/llmtrain-checkpoints"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == ExitCode.FATAL
    assert "checkpoint.url='/proc/llmtrain-checkpoints' is not writable" in proc.stderr


def test_a_toml_file_names_the_preset_it_starts_from(tmp_path):
    """Without ``preset``, a file starts from the table's defaults (4 layers, bf16); with
    it, from that preset (debug_cpu's 2 layers, fp32), its own fields on top, through a
    chain of files; a circle or a wrong name is an error naming the file."""
    plain = tmp_path / "plain.toml"
    plain.write_text("[training]\nsteps = 10\n")
    cfg = load_config(str(plain))
    assert (cfg.model.n_layers, cfg.parallelism.param_dtype) == (4, "bfloat16")
    named = tmp_path / "named.toml"
    named.write_text('preset = "debug_cpu"\n[training]\nsteps = 10\n')
    cfg = load_config(str(named))
    assert (cfg.model.n_layers, cfg.parallelism.param_dtype, cfg.training.steps,
            cfg.training.global_batch_size) == (2, "float32", 10, 16)
    chained = tmp_path / "sub" / "chained.toml"
    chained.parent.mkdir()
    chained.write_text('preset = "../named.toml"\n[model]\ndim = 64\n')
    cfg = load_config(str(chained))
    assert (cfg.model.dim, cfg.model.n_layers, cfg.training.steps) == (64, 2, 10)
    (tmp_path / "a.toml").write_text('preset = "b.toml"\n')
    (tmp_path / "b.toml").write_text('preset = "./a.toml"\n')
    with pytest.raises(ConfigError, match="circle"):
        load_config(str(tmp_path / "a.toml"))
    (tmp_path / "wrong.toml").write_text('preset = "llama9"\n')
    with pytest.raises(ConfigError, match="unknown preset 'llama9'"):
        load_config(str(tmp_path / "wrong.toml"))
    (tmp_path / "number.toml").write_text("preset = 3\n")
    with pytest.raises(ConfigError, match="must name a preset"):
        load_config(str(tmp_path / "number.toml"))


def test_tensor_parallel_must_split_heads_ffn_vocab_and_sequence_evenly():
    cfg = load_config("debug_cpu", [("parallelism.tp", 4)])  # 2 KV heads
    with pytest.raises(ConfigError) as e:
        cfg.validate(4)
    assert str(e.value).startswith("parallelism.tp=4 does not divide model.n_kv_heads=2:")
    assert "set parallelism.tp=2 (the largest that divides them all)" in str(e.value)
    cfg = load_config("debug_cpu", [("parallelism.tp", 2), ("data.seq_len", 63)])
    with pytest.raises(ConfigError, match=r"does not divide data.seq_len=63"):
        cfg.validate(4)
    with pytest.raises(ConfigError, match=r"parallelism.tp=2 does not divide a world of 3"):
        load_config("debug_cpu", [("parallelism.tp", 2)]).validate(3)
    with pytest.raises(ConfigError, match=r"activation_checkpoint='full' with parallelism.compile "
                                          r"and parallelism.tp=2 fails .* use "
                                          r"activation_checkpoint='selective'"):
        load_config("debug_cpu", [("parallelism.tp", 2), ("parallelism.compile", True),
                                  ("parallelism.activation_checkpoint", "full")]).validate(2)
    with pytest.raises(ConfigError, match=r"integrity.recompute_every=5 needs parallelism.tp=1"):
        load_config("debug_cpu", [("parallelism.tp", 2),
                                  ("integrity.recompute_every", 5)]).validate(4)


def test_tensor_parallel_ranks_share_their_data_and_the_batch_counts_dp_ranks():
    cfg = load_config("debug_cpu", [("parallelism.tp", 2), ("training.micro_batch_size", 4)])
    cfg.validate(4)
    assert cfg.mesh_shape(4) == (1, 2)
    assert cfg.accumulation_steps(4) == 2  # 16 sequences over 2 data-parallel ranks of 4
    assert [cfg.data_rank(rank, 4) for rank in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]


def test_llama3_405b_trains_on_16k_gpus_with_tp_8_and_16m_tokens_a_step(capsys):
    """FSDP alone at 16,384 ranks needs a global batch of at least 16,384 sequences (134M
    tokens); with TP 8 inside each node, 2,048 sequences of 8,192 tokens make a step."""
    assert main(["config", "--config", "llama3_405b", "--world-size", "16384",
                 "--data.path", "s3://bucket/tokens"]) == 0
    derived = json.loads(capsys.readouterr().out)["derived"]
    assert derived["mesh"] == {"dp_replicate": 1, "dp_shard": 2048, "tp": 8}
    assert derived["tokens_per_step"] == 2048 * 8192 <= 2 ** 24
    assert derived["accumulation_steps"] == 1
    assert load_config("llama3_70b").parallelism.tp == 8
