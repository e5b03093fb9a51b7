"""Tokens on disk, samples out of them, and the order ranks read them in.

Token shard format (``*.bin``), little-endian throughout::

    offset  size  field
         0     8  magic  b"LLMTOK01"
         8     4  uint32 itemsize: 2 (uint16 tokens) or 4 (uint32 tokens)
        12     4  uint32 reserved, 0
        16     8  uint64 token count
        24     8  zero padding (keeps the tokens 32-byte aligned)
        32     …  the tokens, ``count * itemsize`` bytes, nothing after them

The header carries the count so a shard cut short by a crashed copy is caught when the
dataset opens, not when a sample from its tail is read hours into a run.

Sample order is a function of the *global* sample index only (see
:class:`~llmtrain.data.sampler.GlobalSampler`), so a run resumed on a different number of
ranks sees exactly the data it would have seen.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import posixpath
import struct
import sysconfig
import time
from typing import TYPE_CHECKING

import fsspec
import numpy as np

from llmtrain.config import ConfigError, DataConfig
from llmtrain.exit_codes import FatalError
from llmtrain.fsio import is_local, join, write_atomic

if TYPE_CHECKING:
    import torch

MAGIC = b"LLMTOK01"
HEADER = struct.Struct("<8sIIQ8x")  # magic, itemsize, reserved, count, padding: 32 bytes
EMBEDDED_SHARD_TOKENS = 4 * 1024 * 1024
# Written last into a directory of shards (the embedded corpus, a prepared one): its shard
# list is the corpus, and nothing is read before it exists.
CORPUS_MANIFEST = "corpus.json"
TOKENIZER_FILE = "tokenizer.json"  # a prepared corpus's copy of its tokenizer
PREPARE_DIR = "_prepare"  # a prepare's progress records (llmtrain.data.prepare)
EMBEDDED_WAIT_S = 600.0  # how long ranks that do not prepare the corpus wait for it
# Directories of the stdlib that are not representative library code (or not stdlib).
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
              "__pycache__"}


class ShardError(FatalError, ValueError):
    """Token shards that cannot be used; the message names the file and the fix."""
    what = "data error: "


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, nothing to download, any text round-trips.

    EOS is 0, the NUL byte: Python source (and text in general) never contains it, so
    it can separate documents without stealing a byte that real text uses.
    """

    vocab_size = 256
    eos_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        # A model can emit a byte sequence that is not valid UTF-8; show it, don't crash.
        return bytes(ids).decode("utf-8", errors="replace")


def write_shard(url: str, tokens: np.ndarray) -> None:
    """Write ``tokens`` as one shard, uint16 when they fit, else uint32."""
    tokens = np.asarray(tokens).reshape(-1)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**32):
        raise ValueError(f"tokens for {url} must lie in [0, 2**32), "
                         f"got [{tokens.min()}, {tokens.max()}]")
    dtype = np.dtype("<u2") if not tokens.size or tokens.max() < 2**16 else np.dtype("<u4")
    header = HEADER.pack(MAGIC, dtype.itemsize, 0, tokens.size)
    write_atomic(url, header + tokens.astype(dtype).tobytes())


class _Shard:
    """One validated shard; reads token ranges by memmap (local) or range reads."""

    def __init__(self, url: str):
        self.url = url
        fix = "re-create it with llmtrain.data.write_shard"
        self.fs, self.path = fsspec.core.url_to_fs(url)
        try:
            size = self.fs.size(self.path)
        except FileNotFoundError:
            raise ShardError(f"shard {url} does not exist; check data.path") from None
        if size < HEADER.size:
            raise ShardError(f"shard {url} is truncated: it has {size} bytes, less than "
                             f"the {HEADER.size}-byte header; {fix}")
        # start/end by keyword: s3fs's third positional parameter is a version id
        header = self.fs.cat_file(self.path, start=0, end=HEADER.size)
        if len(header) < HEADER.size:  # cut short since its size was read
            raise ShardError(f"shard {url} is truncated: reading its {HEADER.size}-byte "
                             f"header gave {len(header)} bytes; {fix}")
        magic, itemsize, _, count = HEADER.unpack(header)
        if magic != MAGIC:
            raise ShardError(f"shard {url} is not a token shard: it starts with {magic!r}, "
                             f"not {MAGIC!r}; {fix}")
        if itemsize not in (2, 4):
            raise ShardError(f"shard {url} has token size {itemsize} bytes, but only 2 and "
                             f"4 are valid; {fix}")
        expected = HEADER.size + count * itemsize
        if size != expected:
            what = "truncated" if size < expected else "longer than its header says"
            raise ShardError(f"shard {url} is {what}: header says {count} tokens "
                             f"({expected} bytes) but the file has {size} bytes; {fix}")
        self.dtype = np.dtype(f"<u{itemsize}")
        self.count = count
        self.memmap = None
        if is_local(self.fs) and count:
            self.memmap = np.memmap(self.path, dtype=self.dtype, mode="r",
                                    offset=HEADER.size, shape=(count,))

    def read(self, start: int, stop: int) -> np.ndarray:
        if self.memmap is not None:
            return self.memmap[start:stop]
        size = self.dtype.itemsize
        raw = self.fs.cat_file(self.path, start=HEADER.size + start * size,
                               end=HEADER.size + stop * size)
        if len(raw) != (stop - start) * size:
            raise ShardError(f"shard {self.url} was cut short while the run read it: tokens "
                             f"[{start}, {stop}) gave {len(raw)} bytes; re-create it")
        return np.frombuffer(raw, dtype=self.dtype)


class TokenDataset:
    """Fixed-length samples cut from token shards; ``ds[i]`` has ``seq_len + 1`` tokens.

    Samples never cross a shard boundary, so two documents in different shards are never
    glued into one sample and each sample needs a single contiguous read.
    """

    def __init__(self, urls: list[str], seq_len: int):
        self.seq_len = seq_len
        shards = [_Shard(u) for u in urls]  # validates every shard now, at start-up
        self.shards, self.starts = [], []
        total = 0
        for shard in shards:
            n = max(0, (shard.count - 1) // seq_len)
            if n:
                self.shards.append(shard)
                self.starts.append(total)
                total += n
        self.num_samples = total
        if not total:
            largest = max((s.count for s in shards), default=0)
            raise ShardError(
                f"the {len(urls)} shard(s) hold fewer than seq_len+1 = {seq_len + 1} tokens "
                f"each (the largest has {largest}), so there is not one sample (samples "
                f"never cross shards); lower data.seq_len or check data.path")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        import torch  # here, not at the top: a launcher's preflight opens the data without it
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        k = bisect.bisect_right(self.starts, i) - 1
        start = (i - self.starts[k]) * self.seq_len
        tokens = self.shards[k].read(start, start + self.seq_len + 1)
        return torch.from_numpy(tokens.astype(np.int64))


def _stdlib_bytes(max_bytes: int) -> bytes:
    """The stdlib's own sources, each followed by EOS, in a fixed order, cut at max_bytes."""
    root = sysconfig.get_paths()["stdlib"]
    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel = os.path.relpath(dirpath, root)
        rel_paths += [os.path.normpath(os.path.join(rel, f)) for f in filenames
                      if f.endswith(".py")]
    parts, size = [], 0
    for rel in sorted(rel_paths):
        with open(os.path.join(root, rel), "rb") as f:
            parts.append(f.read() + bytes([ByteTokenizer.eos_id]))
        size += len(parts[-1])
        if size >= max_bytes:
            break
    return b"".join(parts)[:max_bytes]


def _committed_corpus(fs: fsspec.AbstractFileSystem, dir_path: str,
                      max_bytes: int) -> list[str] | None:
    """The shard names the corpus marker commits for ``max_bytes``, if all are there."""
    fs.invalidate_cache(dir_path)  # an object store's cached listing may predate the marker
    try:
        manifest = json.loads(fs.cat_file(join(dir_path, CORPUS_MANIFEST)))
    except (FileNotFoundError, ValueError):
        return None
    names = [s["name"] for s in manifest["shards"]]
    if manifest["max_bytes"] != max_bytes or not all(fs.exists(join(dir_path, n))
                                                     for n in names):
        return None
    return names


def prepare_embedded_corpus(data_dir_url: str, max_bytes: int, *, preparer: bool = True,
                            wait_s: float = EMBEDDED_WAIT_S) -> list[str]:
    """Byte-tokenize the stdlib sources into shards under ``data_dir_url``; their URLs.

    Only a ``preparer`` writes; the others poll for the marker ``corpus.json``, which is
    written after every shard, so no reader ever opens a shard that is still being
    written. Preparers may run at once (one per node on a shared run dir): each builds
    the same bytes and writes every file atomically, so a reader only ever meets whole,
    identical shards. A committed corpus is reused.
    """
    fs, dir_path = fsspec.core.url_to_fs(data_dir_url)
    deadline = time.monotonic() + wait_s
    while (names := _committed_corpus(fs, dir_path, max_bytes)) is None and not preparer:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"waited {wait_s:.0f} s for {join(data_dir_url, CORPUS_MANIFEST)}, which "
                f"this node's local rank 0 writes once the embedded corpus is complete; "
                f"see that rank's log for why it has not, or, if it is only slow, lower "
                f"data.embedded_max_bytes or prepare the corpus before the job starts "
                f"(`llmtrain launch` does in its preflight)")
        time.sleep(0.5)
    if names is not None:
        return [join(data_dir_url, n) for n in names]
    tokens = np.frombuffer(_stdlib_bytes(max_bytes), dtype=np.uint8).astype(np.uint16)
    shards = []
    for i, start in enumerate(range(0, len(tokens), EMBEDDED_SHARD_TOKENS)):
        chunk = tokens[start:start + EMBEDDED_SHARD_TOKENS]
        name = f"embedded-{i:05d}.bin"
        write_shard(join(data_dir_url, name), chunk)
        shards.append({"name": name, "tokens": len(chunk)})
    manifest = {"max_bytes": max_bytes, "shards": shards,
                "sha256": hashlib.sha256(tokens.astype("<u2").tobytes()).hexdigest()}
    write_atomic(join(data_dir_url, CORPUS_MANIFEST),
                 json.dumps(manifest, indent=1).encode())
    return [join(data_dir_url, s["name"]) for s in shards]


def corpus_manifest(data_cfg: DataConfig) -> dict | None:
    """``corpus.json`` of data.path (``llmtrain data prepare`` writes it), if there is one."""
    fs, root = fsspec.core.url_to_fs(data_cfg.path)
    try:
        return json.loads(fs.cat_file(join(root, CORPUS_MANIFEST)))
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise ShardError(f"{join(data_cfg.path, CORPUS_MANIFEST)} is not valid JSON ({e}); "
                         f"run `llmtrain data prepare` again into a new directory") from None


def check_vocab(data_cfg: DataConfig, vocab_size: int) -> None:
    """ConfigError unless the model's vocabulary holds every token the corpus can have."""
    if data_cfg.source != "tokens" or (manifest := corpus_manifest(data_cfg)) is None:
        return
    tok = manifest.get("tokenizer", {})
    need = max(tok.get("vocab_size", 0), manifest.get("max_token_id", -1) + 1)
    if vocab_size < need:
        raise ConfigError(
            f"model.vocab_size={vocab_size} is smaller than the vocabulary of the tokenizer "
            f"that prepared data.path={data_cfg.path!r} ({need} tokens, tokenizer "
            f"{tok.get('url', '?')}, sha256 {tok.get('sha256', '?')[:12]}); set "
            f"model.vocab_size to at least {need} (a multiple of 64 runs faster: "
            f"{-(-need // 64) * 64}), or prepare the data with the model's tokenizer")


def shard_urls(data_cfg: DataConfig, run_dir_url: str) -> list[str]:
    """The shard URLs a run reads, in a fixed order (the sample index depends on it)."""
    if data_cfg.source == "embedded":
        # One preparer per node, as the run dir may be node-local: local rank 0, or a
        # process outside torchrun (the launcher's preflight).
        return prepare_embedded_corpus(join(run_dir_url, "data/embedded"),
                                       data_cfg.embedded_max_bytes,
                                       preparer=os.environ.get("LOCAL_RANK", "0") == "0")
    fs, root = fsspec.core.url_to_fs(data_cfg.path)
    if not fs.isdir(root):
        raise ShardError(f"data.path={data_cfg.path!r} is not a directory; check data.path")
    if (manifest := corpus_manifest(data_cfg)) is not None:
        return [join(data_cfg.path, s["name"]) for s in manifest["shards"]]
    if fs.exists(join(root, PREPARE_DIR)):
        raise ShardError(f"data.path={data_cfg.path!r} holds a `llmtrain data prepare` that "
                         f"has not finished (there is no {CORPUS_MANIFEST} yet); run it again "
                         f"with the same arguments to finish it")
    names = sorted(posixpath.basename(p) for p in fs.glob(join(root, "*.bin")))
    if not names:
        raise ShardError(f"data.path={data_cfg.path!r} holds no *.bin token shards; check "
                         f"data.path, or write shards with llmtrain.data.write_shard")
    return [join(data_cfg.path, n) for n in names]
