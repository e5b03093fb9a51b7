import math

import pytest
import torch
import torch.nn.functional as F

from llmtrain.config import ModelConfig
from llmtrain.model import (Attention, RMSNorm, Transformer, apply_rope, count_params,
                            flops_per_token, rope_tables)


@pytest.fixture(autouse=True)
def one_thread():
    """These models are tiny: intra-op threads only add sync cost, which on a loaded
    machine turned the training test from 0.1 s into 25 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(**overrides) -> ModelConfig:
    fields = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
                  max_seq_len=32)
    return ModelConfig(**(fields | overrides))


LLAMA3_8B = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                 ffn_dim_multiplier=1.3, multiple_of=1024)
LLAMA3_70B = dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                  ffn_dim_multiplier=1.3, multiple_of=4096)
LLAMA3_405B = dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                   ffn_dim_multiplier=1.2, multiple_of=4096)


def tokens(cfg: ModelConfig, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, seq),
                         generator=torch.Generator().manual_seed(seed))


def test_forward_shape_below_max_seq_len():
    cfg = tiny()
    logits = Transformer(cfg)(tokens(cfg, batch=3, seq=10))
    assert logits.shape == (3, 10, cfg.vocab_size)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_forward_rejects_sequences_longer_than_rope_tables():
    cfg = tiny(max_seq_len=8)
    with pytest.raises(ValueError, match="max_seq_len"):
        Transformer(cfg)(tokens(cfg, seq=9))


def test_causal_changing_a_token_leaves_earlier_logits_alone():
    cfg = tiny()
    model = Transformer(cfg)
    a = tokens(cfg)
    b = a.clone()
    b[:, 5] = (b[:, 5] + 1) % cfg.vocab_size
    la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :5], lb[:, :5], rtol=0, atol=1e-6)
    assert not torch.allclose(la[:, 5:], lb[:, 5:])


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_grouped_query_attention_matches_repeated_kv_reference(n_kv_heads):
    cfg = tiny(n_heads=4, n_kv_heads=n_kv_heads)
    torch.manual_seed(0)
    attn = Attention(cfg)
    head_dim = cfg.dim // cfg.n_heads
    assert attn.wk.weight.shape == (n_kv_heads * head_dim, cfg.dim)
    seq = 12
    x = torch.randn(2, seq, cfg.dim)
    cos, sin = (t[:seq] for t in rope_tables(head_dim, cfg.max_seq_len, cfg.rope_theta))

    q = apply_rope(attn.wq(x).view(2, seq, cfg.n_heads, head_dim), cos, sin).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(2, seq, n_kv_heads, head_dim), cos, sin).transpose(1, 2)
    v = attn.wv(x).view(2, seq, n_kv_heads, head_dim).transpose(1, 2)
    group = cfg.n_heads // n_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    expected = attn.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, seq, cfg.dim))

    torch.testing.assert_close(attn(x, cos, sin), expected, rtol=1e-5, atol=1e-5)


def test_rms_norm_scales_by_root_mean_square_and_weight():
    norm = RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 9.0))
    x = torch.randn(3, 8) * 5
    expected = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * norm.weight
    torch.testing.assert_close(norm(x), expected)


def test_rope_tables_use_theta():
    cos, sin = rope_tables(head_dim=8, max_seq_len=4, theta=500000.0)
    assert cos.shape == sin.shape == (4, 4) and cos.dtype == torch.float32
    angle = 3 * 500000.0 ** (-2 / 8)  # position 3, second pair
    assert cos[3, 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    assert sin[3, 1].item() == pytest.approx(math.sin(angle), abs=1e-6)


def test_rope_scores_depend_only_on_relative_position():
    head_dim, seq = 16, 32
    cos, sin = rope_tables(head_dim, seq, theta=10000.0)
    q, k = torch.randn(head_dim), torch.randn(head_dim)

    def score(m: int, n: int) -> torch.Tensor:
        # Every position holds the same q (and k); only the rotation differs.
        rq = apply_rope(q.expand(1, seq, 1, head_dim), cos, sin)[0, m, 0]
        rk = apply_rope(k.expand(1, seq, 1, head_dim), cos, sin)[0, n, 0]
        return rq @ rk

    torch.testing.assert_close(score(7, 3), score(20, 16), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(score(7, 3), score(7, 4), atol=1e-3)


@pytest.mark.parametrize("tie", [False, True])
def test_count_params_matches_built_model(tie):
    cfg = tiny(tie_embeddings=tie, n_kv_heads=1, ffn_dim_multiplier=1.3)
    model = Transformer(cfg)
    assert (model.output.weight is model.tok_embeddings.weight) == tie
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    assert (count_params(cfg, exclude_embedding=True)
            == count_params(cfg) - model.tok_embeddings.weight.numel())


@pytest.mark.parametrize("fields, hidden, total", [
    (LLAMA3_8B, 14336, 8_030_261_248),
    (LLAMA3_70B, 28672, 70_553_706_496),
])
def test_published_llama3_sizes_are_exact(fields, hidden, total):
    cfg = ModelConfig(**fields)
    assert cfg.ffn_hidden_dim() == hidden
    assert count_params(cfg) == total


def test_llama3_405b_size():
    cfg = ModelConfig(**LLAMA3_405B)
    assert cfg.ffn_hidden_dim() == 53248
    assert count_params(cfg) == pytest.approx(405.9e9, rel=1e-3)


def test_init_weights_is_seeded_and_independent_of_global_rng():
    cfg = tiny()
    a, b = Transformer(cfg), Transformer(cfg)
    a.init_weights(seed=7)
    torch.manual_seed(123)
    torch.rand(1000)
    b.init_weights(seed=7)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name

    torch.manual_seed(0)
    b.init_weights(seed=8)
    after_init = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(1), after_init), "a seeded init must not consume global RNG"
    assert not torch.equal(a.layers["0"].attention.wq.weight, b.layers["0"].attention.wq.weight)


def test_init_weights_scales():
    cfg = tiny(dim=64, n_layers=8, init_std=0.05)
    model = Transformer(cfg)
    model.init_weights(seed=0)
    block = model.layers["3"]
    assert torch.equal(block.attention_norm.weight, torch.ones(cfg.dim))
    assert torch.equal(model.norm.weight, torch.ones(cfg.dim))
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    for w, std in ((block.attention.wq.weight, cfg.init_std),
                   (model.tok_embeddings.weight, cfg.init_std),
                   (block.attention.wo.weight, residual_std),
                   (block.feed_forward.w2.weight, residual_std)):
        assert w.std().item() == pytest.approx(std, rel=0.1)
        assert abs(w.mean().item()) < 0.1 * std


def test_init_weights_after_meta_and_to_empty_matches_eager_model():
    cfg = tiny(tie_embeddings=True)
    eager = Transformer(cfg)
    eager.init_weights(seed=3)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert model.rope_cos.is_meta
    model.to_empty(device="cpu")
    model.init_weights(seed=3)

    assert model.output.weight is model.tok_embeddings.weight
    assert "rope_cos" not in model.state_dict()
    for name, value in eager.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    # Equal logits also show the rope tables were recomputed, not left as to_empty garbage.
    x = tokens(cfg)
    torch.testing.assert_close(model(x), eager(x), rtol=0, atol=0)


def test_init_weights_ignores_the_wrappers_parallelize_adds():
    """Init seeds are keyed by parameter name; activation checkpointing and compile put
    prefixes into the names, which must not change the weights."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    cfg = tiny()
    plain, wrapped = Transformer(cfg), Transformer(cfg)
    for name, block in list(wrapped.layers.items()):
        wrapped.layers[name] = torch.compile(checkpoint_wrapper(block))
    assert "_orig_mod._checkpoint_wrapped_module" in next(
        n for n, _ in wrapped.named_parameters() if n.startswith("layers."))
    plain.init_weights(seed=4)
    wrapped.init_weights(seed=4)
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("tie", [False, True])
def test_flops_per_token_formula(tie):
    cfg = tiny(tie_embeddings=tie)
    model = Transformer(cfg)
    # Weights used in a matmul: all but the embedding lookup, which a tied output
    # projection shares yet still multiplies with.
    matmul = sum(p.numel() for n, p in model.named_parameters() if n != "tok_embeddings.weight")
    if tie:
        matmul += cfg.vocab_size * cfg.dim
    seq_len = 24
    expected = 6 * matmul + 12 * cfg.n_layers * cfg.dim * seq_len
    assert flops_per_token(cfg, seq_len) == expected > 0


def test_loss_falls_on_a_repeated_batch():
    torch.manual_seed(0)
    cfg = tiny()
    model = Transformer(cfg)
    model.init_weights(seed=0)
    batch = tokens(cfg, batch=4, seq=17)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(cfg.vocab_size), rel=0.05)
    assert losses[-1] < 0.2 * losses[0], losses
