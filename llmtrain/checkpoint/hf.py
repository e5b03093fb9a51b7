"""Hugging Face Llama format: export a checkpoint as safetensors + config.json that
``transformers.LlamaForCausalLM`` loads, with the tokenizer of the corpus it was trained on
(tokenizer.json + tokenizer_config.json, for ``AutoTokenizer``), and start a run from such
a directory.

The one real difference between the layouts is rotary embeddings: llmtrain rotates
adjacent pairs of each head's channels (Meta's layout), Hugging Face Llama rotates the
first half against the second (``rotate_half``). The same model in both conventions has
the rows of ``wq`` and ``wk`` permuted within each head: Meta channel ``2j + t`` is
Hugging Face channel ``t * head_dim/2 + j``. Everything else maps by name.

Import reads each rank's slice of each tensor only (``safe_open(...).get_slice``), so a
rank of a sharded model never holds a whole weight; safetensors needs a local path (or a
mount) for that. Export loads the whole model into this process's memory.
"""

from __future__ import annotations

import hashlib
import json
import math
import posixpath
from contextlib import ExitStack

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from llmtrain.checkpoint import shard_read, storage
from llmtrain.config import ConfigError, DataConfig, ModelConfig
from llmtrain.fsio import is_local, join, write_atomic
from llmtrain.model import Transformer, global_offset, unwrapped_name

SAFETENSORS_INDEX = "model.safetensors.index.json"
MAX_FILE_BYTES = 5 * 2**30  # per safetensors file, as Hugging Face shards them
_LAYER = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
          "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
          "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
          "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm",
          "ffn_norm": "post_attention_layernorm"}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def hf_name(name: str) -> str:
    """The Hugging Face name of llmtrain parameter ``name``."""
    if name in _TOP:
        return _TOP[name]
    _, layer, rest = name.split(".", 2)  # layers.N.<module>.weight
    module, _, param = rest.rpartition(".")
    return f"model.layers.{layer}.{_LAYER[module]}.{param}"


def _rope_heads(name: str, cfg: ModelConfig) -> int:
    """Heads whose rows are permuted between the layouts (0: none)."""
    if name.endswith("attention.wq.weight"):
        return cfg.n_heads
    return cfg.n_kv_heads if name.endswith("attention.wk.weight") else 0


def to_hf_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Meta (adjacent pairs) rows of ``heads`` whole heads -> Hugging Face (halves)."""
    return w.unflatten(0, (heads, -1, 2)).transpose(1, 2).flatten(0, 2)


def from_hf_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face (halves) rows of ``heads`` whole heads -> Meta (adjacent pairs)."""
    return w.unflatten(0, (heads, 2, -1)).transpose(1, 2).flatten(0, 2)


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.dim // cfg.n_heads, "intermediate_size": cfg.ffn_hidden_dim(),
            "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps,
            # rope_theta for transformers 4, rope_parameters for 5
            "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "max_position_embeddings": cfg.max_seq_len, "hidden_act": "silu",
            "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
            "mlp_bias": False, "initializer_range": cfg.init_std,
            "torch_dtype": str(dtype).removeprefix("torch.")}


def export(ckpt_url: str, out_url: str, cfg: ModelConfig | None = None,
           tokenizer: str = "") -> tuple[list[str], str]:
    """Writes the model of the checkpoint at ``ckpt_url`` to ``out_url`` in the Hugging
    Face Llama format, with the tokenizer of the corpus it was trained on (or
    ``tokenizer``, a tokenizer.json URL); returns the files written, and why no tokenizer
    was written when none was. ``cfg`` is the model's config where the checkpoint's
    manifest does not record it."""
    problems = storage.verify(ckpt_url, checksums=True)  # before DCP unpickles anything
    if problems:
        raise ConfigError(f"checkpoint {ckpt_url} does not verify, so it is not exported: "
                          f"{'; '.join(problems[:5])}; export another checkpoint")
    manifest = storage.read_manifest(ckpt_url)
    if "model_config" in manifest:
        cfg = ModelConfig(**manifest["model_config"])
    elif cfg is None:
        raise ConfigError(f"checkpoint {ckpt_url} does not record its model config; give "
                          f"the run's --config (and model overrides)")
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items()}
    if cfg.tie_embeddings:
        shapes.pop("output.weight")
    reader = shard_read.ShardReader(ckpt_url)
    saved = reader.read_metadata().state_dict_metadata
    for name, shape in shapes.items():
        got = getattr(saved.get(f"model.{name}"), "size", None)
        if got != shape:
            raise ConfigError(
                f"checkpoint {ckpt_url} holds model.{name} of shape "
                f"{list(got) if got is not None else 'none'}, the model config gives "
                f"{list(shape)}; give the --config (and model overrides) of the run that "
                f"wrote it")
    state = {f"model.{k}": torch.empty(v, dtype=saved[f"model.{k}"].properties.dtype)
             for k, v in shapes.items()}
    dcp.load(state, storage_reader=reader, no_dist=True)
    tensors = {}
    for name in shapes:
        w = state[f"model.{name}"]
        heads = _rope_heads(name, cfg)
        tensors[hf_name(name)] = (to_hf_rows(w, heads) if heads else w).contiguous()
    dtype = next(iter(tensors.values())).dtype
    found, why_not = find_tokenizer(manifest, tokenizer)
    config = hf_config(cfg, dtype)
    if found is not None:
        config["eos_token_id"] = found[1].get("eos_id")
    written = _write(out_url, tensors, config)
    if found is not None:
        written += _write_tokenizer(out_url, *found, cfg)
    return written, why_not


def find_tokenizer(manifest: dict, given: str = "") -> tuple[tuple[bytes, dict] | None, str]:
    """The tokenizer.json a checkpoint's model reads (``given``, else the one its corpus
    records, checked against the corpus's sha256), and what ``corpus.json`` says of it;
    else None and why."""
    from llmtrain.data import corpus_manifest
    if given:  # its end-of-document token found as `data prepare` finds it
        from llmtrain.data.prepare import Tokenizer
        tok = Tokenizer(given)
        return (tok.json.encode("utf-8"), tok.describe(given)), ""
    data = manifest.get("data")
    if data is None:
        return None, ("the checkpoint does not record its data (saved before llmtrain "
                      "recorded it); pass --tokenizer URL")
    if data["source"] != "tokens":
        return None, (f"data.source={data['source']!r}: the model reads bytes (token = byte "
                      f"value), there is no tokenizer")
    corpus = corpus_manifest(DataConfig(source="tokens", path=data["path"]))
    record = (corpus or {}).get("tokenizer")
    if record is None:
        return None, (f"{join(data['path'], 'corpus.json')} names no tokenizer (shards not "
                      f"made by `llmtrain data prepare`); pass --tokenizer URL")
    urls = ([join(data["path"], record["file"])] if "file" in record else []) + [record["url"]]
    for url in urls:
        try:
            with fsspec.open(url, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            continue
        if hashlib.sha256(raw).hexdigest() == record["sha256"]:
            return (raw, record), ""
    raise ConfigError(f"the tokenizer the corpus {data['path']} was prepared with (sha256 "
                      f"{record['sha256'][:12]}) is at none of {urls}, or was changed since; "
                      f"pass --tokenizer URL of that tokenizer.json")


def _write_tokenizer(out_url: str, raw: bytes, record: dict, cfg: ModelConfig) -> list[str]:
    """tokenizer.json as is, and the tokenizer_config.json that lets ``AutoTokenizer``
    load it as a fast tokenizer with the corpus's end-of-document token."""
    write_atomic(join(out_url, "tokenizer.json"), raw)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": record.get("eos"),
              "model_max_length": cfg.max_seq_len, "clean_up_tokenization_spaces": False}
    write_atomic(join(out_url, "tokenizer_config.json"), json.dumps(config, indent=1).encode())
    return ["tokenizer.json", "tokenizer_config.json"]


def _write(out_url: str, tensors: dict[str, torch.Tensor], config: dict) -> list[str]:
    from safetensors.torch import save
    files: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if files[-1] and size + nbytes > MAX_FILE_BYTES:
            files.append({})
            size = 0
        files[-1][name] = t
        size += nbytes
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    for name, part in zip(names, files):
        write_atomic(join(out_url, name), save(part, metadata={"format": "pt"}))
    written = list(names)
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                                for t in tensors.values())},
                 "weight_map": {t: n for n, part in zip(names, files) for t in part}}
        write_atomic(join(out_url, SAFETENSORS_INDEX), json.dumps(index, indent=1).encode())
        written.append(SAFETENSORS_INDEX)
    write_atomic(join(out_url, "config.json"), json.dumps(config, indent=1).encode())
    return written + ["config.json"]


def _check_config(hf: dict, cfg: ModelConfig, url: str) -> None:
    """ConfigError naming the first model field that does not match ``config.json``."""
    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    if hf.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        raise ConfigError(f"checkpoint.init_from={url!r} uses rope scaling "
                          f"({hf.get('rope_scaling') or rope}), which llmtrain's model does "
                          f"not implement; start from a model without it")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConfigError(f"checkpoint.init_from={url!r} is not a plain Llama (hidden_act "
                          f"{hf.get('hidden_act')}, attention_bias {hf.get('attention_bias')}, "
                          f"mlp_bias {hf.get('mlp_bias')}); llmtrain's model is SwiGLU "
                          f"without biases")
    pairs = [("model.dim", cfg.dim, "hidden_size", hf.get("hidden_size")),
             ("model.n_layers", cfg.n_layers, "num_hidden_layers", hf.get("num_hidden_layers")),
             ("model.n_heads", cfg.n_heads, "num_attention_heads",
              hf.get("num_attention_heads")),
             ("model.n_kv_heads", cfg.n_kv_heads, "num_key_value_heads",
              hf.get("num_key_value_heads", hf.get("num_attention_heads"))),
             ("model.vocab_size", cfg.vocab_size, "vocab_size", hf.get("vocab_size")),
             ("model.tie_embeddings", cfg.tie_embeddings, "tie_word_embeddings",
              hf.get("tie_word_embeddings", False)),
             ("model.rope_theta", cfg.rope_theta, "rope_theta", theta),
             ("model.norm_eps", cfg.norm_eps, "rms_norm_eps", hf.get("rms_norm_eps"))]
    for field, ours, key, theirs in pairs:
        if ours != theirs:
            raise ConfigError(f"{field}={ours} but checkpoint.init_from={url!r} has "
                              f"{key}={theirs}; set --{field} {theirs}")
    if hf.get("head_dim", cfg.dim // cfg.n_heads) != cfg.dim // cfg.n_heads:
        raise ConfigError(f"checkpoint.init_from={url!r} has head_dim={hf['head_dim']}, not "
                          f"hidden_size / num_attention_heads; llmtrain's model cannot hold it")
    if cfg.ffn_hidden_dim() != hf.get("intermediate_size"):
        raise ConfigError(
            f"model.ffn_dim_multiplier={cfg.ffn_dim_multiplier} and model.multiple_of="
            f"{cfg.multiple_of} give a SwiGLU hidden size of {cfg.ffn_hidden_dim()}, but "
            f"checkpoint.init_from={url!r} has intermediate_size="
            f"{hf.get('intermediate_size')}; choose values that give it (Llama 3 8B: 1.3 "
            f"and 1024)")


@torch.no_grad()
def load(model: torch.nn.Module, url: str, cfg: ModelConfig) -> None:
    """Sets every parameter of ``model`` (sharded or whole) from the Hugging Face Llama
    directory ``url``, each rank reading only the rows of its own shards."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise ConfigError("checkpoint.init_from needs the 'hf' extra (safetensors is not "
                          "installed): pip install 'llmtrain[hf]'") from None
    fs, root = fsspec.core.url_to_fs(url)
    if not is_local(fs):
        raise ConfigError(f"checkpoint.init_from={url!r} is not on a local or mounted "
                          f"file system, which safetensors needs to read slices; copy it "
                          f"to local disk first")
    try:
        hf = json.loads(fs.cat_file(posixpath.join(root, "config.json")))
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"checkpoint.init_from={url!r} has no readable config.json "
                          f"({type(e).__name__}: {e}); give a Hugging Face model "
                          f"directory") from None
    _check_config(hf, cfg, url)
    if fs.exists(posixpath.join(root, SAFETENSORS_INDEX)):
        weight_map = json.loads(fs.cat_file(posixpath.join(root, SAFETENSORS_INDEX)))[
            "weight_map"]
    else:
        single = posixpath.join(root, "model.safetensors")
        if not fs.exists(single):
            raise ConfigError(f"checkpoint.init_from={url!r} holds neither model.safetensors "
                              f"nor {SAFETENSORS_INDEX}; give a directory in safetensors")
        with safe_open(single, "pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    with ExitStack() as stack:
        files = {}
        for name, param in model.named_parameters():
            name = unwrapped_name(name)
            key = hf_name(name)
            if key not in weight_map:
                raise ConfigError(f"checkpoint.init_from={url!r} has no tensor {key} (for "
                                  f"{name}); is it a Llama model of this shape?")
            file = weight_map[key]
            if file not in files:
                files[file] = stack.enter_context(safe_open(posixpath.join(root, file), "pt"))
            _load_param(param, files[file].get_slice(key), name, cfg)


def _load_param(param: torch.Tensor, src, name: str, cfg: ModelConfig) -> None:
    local = param.to_local() if isinstance(param, DTensor) else param
    if list(src.get_shape()) != list(param.shape):
        raise ConfigError(f"the Hugging Face tensor {hf_name(name)} has shape "
                          f"{src.get_shape()}, the model's {name} {list(param.shape)}")
    if local.numel() == 0:
        return
    offset = global_offset(param)
    first, end = offset[0], offset[0] + local.shape[0]
    heads = _rope_heads(name, cfg)
    if heads:  # whole heads are read, permuted, then cut to this shard's rows
        head_dim = param.shape[0] // heads
        lo, hi = first // head_dim * head_dim, math.ceil(end / head_dim) * head_dim
        piece = from_hf_rows(src[lo:hi], (hi - lo) // head_dim)[first - lo:end - lo]
    else:
        piece = src[first:end]
    for dim in range(1, param.ndim):  # shards along other dims (tensor parallel)
        piece = piece.narrow(dim, offset[dim], local.shape[dim])
    local.copy_(piece)
