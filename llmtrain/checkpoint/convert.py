"""``llmtrain ckpt convert``: a committed checkpoint rewritten in another format.

- ``raw`` and ``dcp`` (``checkpoint.format``): a new committed checkpoint, manifest and
  all, that a run resumes from as from the original; ``dcp`` is what stock DCP readers
  (``dcp.load``, ``dcp_to_torch_save``, torchtitan) load without llmtrain.
- ``torch``: one ``torch.save`` file of the whole state, as ``dcp_to_torch_save`` writes.

The source is verified (every checksum) before it is read, and what was written is read
back and compared, tensor by tensor, bit for bit, before the command succeeds. The whole
state is held in this process's memory, twice while the result is compared: run it where
the model fits (a 70B model's state is ~1 TB with its optimizer).
"""

from __future__ import annotations

import io
import os

import fsspec
import torch
import torch.distributed.checkpoint as dcp

from llmtrain.checkpoint import shard_read, storage
from llmtrain.config import ConfigError
from llmtrain.fsio import write_atomic

FORMATS = ("raw", "dcp", "torch")
# what describes the source's files, not the state: the new commit writes its own
_FILE_FIELDS = ("files", "bytes", "committed_at", "format")


def convert(src: str, to: str, dst: str) -> None:
    """Writes the checkpoint at ``src`` to ``dst`` in format ``to``; raises ConfigError
    when ``src`` does not verify, ``dst`` exists, or the result differs from ``src``."""
    if to not in FORMATS:
        raise ConfigError(f"ckpt convert --to {to!r}: choose one of {', '.join(FORMATS)}")
    problems = storage.verify(src, checksums=True)  # before DCP unpickles anything of it
    if problems:
        raise ConfigError(f"checkpoint {src} does not verify, so it is not converted: "
                          f"{'; '.join(problems[:5])}")
    fs, path = fsspec.core.url_to_fs(dst)
    if fs.exists(path):
        raise ConfigError(f"ckpt convert: {dst} exists; give a new destination")
    state = shard_read.load_unsharded(src)
    if to == "torch":
        buffer = io.BytesIO()
        torch.save(state, buffer)
        write_atomic(dst, buffer.getvalue())
        with fsspec.open(dst, "rb") as f, torch.serialization.safe_globals([io.BytesIO]):
            written = torch.load(f, weights_only=True)
    else:
        manifest = {k: v for k, v in storage.read_manifest(src).items()
                    if k not in _FILE_FIELDS}
        writer = storage.CommitWriter(dst, {**manifest, "converted_from": src},
                                      thread_count=min(4, os.cpu_count() or 1),
                                      raw=to == "raw")
        dcp.save(state, storage_writer=writer, no_dist=True)
        problems = storage.verify(dst, checksums=True)
        if problems:
            raise ConfigError(f"ckpt convert: {dst} does not verify once written: "
                              f"{'; '.join(problems[:5])}")
        written = shard_read.load_unsharded(dst)
    differ = differences(state, written)
    if differ:
        raise ConfigError(f"ckpt convert: {dst} read back differs from {src} in "
                          f"{', '.join(differ[:10])}")


def differences(a, b, at: str = "") -> list[str]:
    """Where two loaded states differ: a tensor's dtype, shape or any bit, a value."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{at or '/'} (keys {sorted(set(a) ^ set(b))[:5]})"]
        return [d for k in a for d in differences(a[k], b[k], f"{at}/{k}")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = (a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_bits(a), _bits(b)))  # NaN == NaN, -0.0 != 0.0
        return [] if same else [at]
    if isinstance(a, io.BytesIO) and isinstance(b, io.BytesIO):
        return [] if a.getvalue() == b.getvalue() else [at]
    return [] if type(a) is type(b) and a == b else [at]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)
