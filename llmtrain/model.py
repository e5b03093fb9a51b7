"""Llama-3-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Parameter names follow Meta's reference (``layers.N.attention.wq.weight``, ...) so that
checkpoints and sharding plans written for Llama map onto this model by name. The blocks
live in an ``nn.ModuleDict`` keyed ``"0"``, ``"1"``, ... so that FSDP2 and activation
checkpointing can wrap each block by replacing its entry without renumbering anything.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from llmtrain.config import ModelConfig


def count_params(cfg: ModelConfig, *, exclude_embedding: bool = False) -> int:
    """Parameter count from the config alone, so it can size models too big to build.

    With ``exclude_embedding`` the input embedding table is left out (it is a lookup, not
    compute); a tied output projection then goes with it, as it is the same tensor.
    """
    head_dim = cfg.dim // cfg.n_heads
    kv_dim = cfg.n_kv_heads * head_dim
    attention = 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv_dim
    feed_forward = 3 * cfg.dim * cfg.ffn_hidden_dim()
    block = attention + feed_forward + 2 * cfg.dim
    embedding = cfg.vocab_size * cfg.dim
    output = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    total = cfg.n_layers * block + cfg.dim + output
    return total if exclude_embedding else total + embedding


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, forward and backward: 6*N + 12*n_layers*dim*seq_len.

    N counts the weights that take part in a matmul: every non-embedding parameter plus
    the output projection, also when it is tied to the embedding (the lookup is free, the
    projection onto the vocabulary is not). Each such weight costs 2 FLOPs per token
    forward and 4 backward. The second term is the attention score and value matmuls
    (QK^T and AV), counted over the full ``seq_len`` without halving for the causal mask,
    as in PaLM's appendix B and torchtitan, so MFU figures compare across codebases.
    """
    matmul_params = count_params(cfg, exclude_embedding=True)
    if cfg.tie_embeddings:
        matmul_params += cfg.vocab_size * cfg.dim
    return float(6 * matmul_params + 12 * cfg.n_layers * cfg.dim * seq_len)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32: a bf16 mean of squares over thousands
    of channels is too coarse."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's rotation angles, [max_seq_len, head_dim // 2], fp32.

    Float32 because bf16 cannot tell apart angles of neighbouring positions late in a
    long sequence.
    """
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                            / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates adjacent pairs of ``x`` [B, T, heads, head_dim] by the angles of its positions.

    Pairs are adjacent (Meta's interleaved layout) rather than split halves, so Meta's
    original Llama checkpoints load without permuting wq and wk. The rotation runs in
    float32 and the result is cast back to the activations' dtype.
    """
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention: n_kv_heads key/value heads shared by n_heads queries."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Head counts come from the projections' outputs (-1), not the config, so a
        # tensor-parallel plan that splits heads across ranks needs no change here.
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True,
                                             enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block; the unit that FSDP2, checkpointing and compile wrap."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim())

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """The decoder: tokens [B, T] -> logits [B, T, vocab_size].

    Built on a real device it is initialized at once (from the global RNG); built on
    ``meta`` it holds no storage until ``to_empty`` and ``init_weights``, which is how
    models too big for one device are sharded before they are materialized.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Non-persistent: derived from the config, so checkpoints need not carry it and
        # FSDP2 leaves it a plain tensor that every rank holds whole.
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta,
                               self.tok_embeddings.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not self.tok_embeddings.weight.is_meta:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Sets every parameter, re-ties the output projection and recomputes the rope tables.

        Each rank draws only the rows of its own shards, so initializing a model sharded
        over N ranks costs each rank 1/N of the whole (drawn whole, a 405B model would be
        405e9 draws on every rank). The values still do not depend on how the model was built
        (directly, or on ``meta`` then sharded and ``to_empty``) nor on the world size: a
        parameter is drawn in float32, in fixed blocks of whole rows along dim 0 (the dim
        FSDP2 shards), each block from its own generator seeded by (seed, parameter name,
        block index); a rank draws the blocks its rows overlap and keeps its rows. The
        block size is a constant, never derived from the world size. On CUDA the blocks
        are drawn by device generators, so a seed gives other numbers than on CPU.
        Without a seed, one is drawn from the global RNG, so ``torch.manual_seed``
        decides an eagerly built model. Residual-branch outputs (wo, w2) get
        std / sqrt(2 * n_layers) so the residual stream's variance does not grow with
        depth (GPT-2's scheme); norm weights start at 1.
        """
        if self.cfg.tie_embeddings:
            # ``to_empty`` from meta gives each module a new Parameter, which unties them.
            self.output.weight = self.tok_embeddings.weight
        if seed is None:
            seed = int(torch.randint(0, 2**63 - 1, ()).item())
        residual_std = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            name = unwrapped_name(name)
            local = param.to_local() if isinstance(param, DTensor) else param
            if name.endswith("norm.weight"):
                local.fill_(1.0)
                continue
            residual = name.endswith(("attention.wo.weight", "feed_forward.w2.weight"))
            std = residual_std if residual else self.cfg.init_std
            _fill_normal(param, local, std, seed, name)
        self.rope_cos, self.rope_sin = rope_tables(
            self.cfg.dim // self.cfg.n_heads, self.cfg.max_seq_len, self.cfg.rope_theta,
            self.rope_cos.device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        if seqlen > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {seqlen} tokens exceeds model.max_seq_len="
                             f"{self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:seqlen], self.rope_sin[:seqlen]
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


# Rows per init block sum to about this many elements (1 MiB of float32): big enough that
# the per-block cost (a generator, a hash) stays near 1% of drawing the block, small
# enough that the rows a rank draws beyond its shard (less than a block at each end)
# stay few even when shards are thin (Llama 3 8B's w1 over 64 ranks: 224 rows a shard,
# 64 rows a block). A constant: blocks that depended on the world size would change the
# weights with it.
INIT_BLOCK_ELEMENTS = 1 << 18

# Module wrappers that ``parallelize`` may insert into parameter names (activation
# checkpointing, torch.compile); the init seed is keyed by the name without them.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def unwrapped_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def global_offset(param: torch.Tensor) -> tuple[int, ...]:
    """Where this rank's shard of ``param`` starts in the whole parameter (a plain
    tensor is whole: all zeros)."""
    if isinstance(param, DTensor):
        return tuple(compute_local_shape_and_global_offset(
            tuple(param.shape), param.device_mesh, param.placements)[1])
    return (0,) * param.ndim


def _block_generator(seed: int, name: str, block: int, device: torch.device) -> torch.Generator:
    """A generator of its own for each (seed, parameter, block): any rank can draw any
    block without drawing the ones before it."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little"))


def _fill_normal(param: torch.Tensor, local: torch.Tensor, std: float, seed: int,
                 name: str) -> None:
    """Fills ``local`` (``param``'s shard, or ``param`` itself) with its part of the
    blockwise N(0, std) draw of the whole parameter."""
    if local.numel() == 0:
        return
    shape = tuple(param.shape)
    offset = global_offset(param)
    rows = max(1, INIT_BLOCK_ELEMENTS // math.prod(shape[1:]))
    first, end = offset[0], offset[0] + local.shape[0]
    for block in range(first // rows, -(-end // rows)):
        start, stop = block * rows, min((block + 1) * rows, shape[0])
        value = torch.empty((stop - start, *shape[1:]), device=local.device)
        value.normal_(0.0, std, generator=_block_generator(seed, name, block, local.device))
        lo, hi = max(first, start), min(end, stop)
        piece = value[lo - start:hi - start]
        for dim in range(1, len(shape)):  # shards along other dims (tensor parallel)
            piece = piece.narrow(dim, offset[dim], local.shape[dim])
        local[lo - first:hi - first].copy_(piece)
