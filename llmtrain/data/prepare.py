"""``llmtrain data prepare``: text, JSONL or Parquet files on any fsspec URL, tokenized by
a Hugging Face ``tokenizers`` tokenizer.json into token shards and a ``corpus.json``.

Each input file is one task, run in parallel over processes (a tokenizer call holds its
process's core; processes scale where threads would fight over the GIL in between). Its
shards are named by the file's position and their own, ``{file:06d}-{shard:05d}.bin``, so
the sample order, which follows the sorted names, follows the inputs' order. Every shard
is written atomically and a shard that exists is never written again; a file's record in
``_prepare/`` is written after its last shard and ``corpus.json`` after every file's. A
killed prepare run again with the same arguments skips the recorded files, re-tokenizes
the others (tokenization is deterministic, so their finished shards are the bytes it
would write) and ends with the shards an uninterrupted run writes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Iterator

import fsspec
import numpy as np

from llmtrain import fault_points
from llmtrain.data import (CORPUS_MANIFEST, PREPARE_DIR, TOKENIZER_FILE, ShardError,
                           write_shard)
from llmtrain.fsio import is_local, join, write_atomic

log = logging.getLogger(__name__)

FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "jsonl",
           ".parquet": "parquet"}
# Names tokenizers give their end-of-document token, tried in this order.
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[SEP]")
BATCH_CHARS = 1 << 20  # text per encode call: big enough to amortize the call, small to hold
TEXT_PIECE_CHARS = 1 << 20  # plain text is read (and tokenized) this much at a time


class PrepareError(ShardError):
    """Input that cannot be prepared; the message names the file and the fix."""


@dataclass
class Config:
    inputs: list[str]
    tokenizer: str = ""  # fsspec URL of a Hugging Face tokenizer.json
    out: str = ""  # fsspec URL of the directory the shards and corpus.json go to
    text_field: str = "text"  # the JSONL key or Parquet column holding each document
    eos: str = ""  # the end-of-document token; empty: the first of EOS_NAMES it has
    workers: int = 0  # processes; 0: one per core
    shard_tokens: int = 256 * 2**20
    faults: str = ""  # injected faults (llmtrain/chaos/faults.py; point prepare_shard)


def expand_inputs(inputs: list[str]) -> list[str]:
    """Every file the inputs name (files, globs, directories), in the order given, each
    glob and directory sorted: the order of the shards and so of the samples."""
    files = []
    for url in inputs:
        fs, path = fsspec.core.url_to_fs(url)
        if fs.isdir(path):
            found = sorted(p for p in fs.find(path) if _format(p, strict=False))
        else:
            found = sorted(fs.glob(path)) if fsspec.core.has_magic(path) else [path]
        if not found or not all(fs.isfile(p) for p in found):
            raise PrepareError(f"input {url!r} names no file; give files, globs or "
                               f"directories of {', '.join(sorted(FORMATS))} files")
        files += [p if is_local(fs) else fs.unstrip_protocol(p) for p in found]
    return files


def _format(path: str, strict: bool = True) -> str | None:
    """The format of ``path`` by its suffix, looking through a compression suffix."""
    name = posixpath.basename(path)
    stem, ext = posixpath.splitext(name)
    if ext.lstrip(".") in fsspec.utils.compressions:
        ext = posixpath.splitext(stem)[1]
    kind = FORMATS.get(ext.lower())
    if kind is None and strict:
        raise PrepareError(f"input {path} is not a known format (by its suffix {ext!r}); "
                           f"give {', '.join(sorted(FORMATS))} files, optionally compressed")
    return kind


def _documents(url: str, text_field: str) -> Iterator[tuple[str, bool]]:
    """``(text, ends_document)`` pieces of ``url``: plain text is one document, read a
    piece at a time; a JSONL line or a Parquet row is one."""
    kind = _format(url)
    if kind == "parquet":
        import pyarrow.parquet as pq
        with fsspec.open(url, "rb") as f:
            pf = pq.ParquetFile(f)
            if text_field not in pf.schema_arrow.names:
                raise PrepareError(f"{url} has no column {text_field!r} (it has "
                                   f"{pf.schema_arrow.names}); pass --field COLUMN")
            for batch in pf.iter_batches(columns=[text_field]):
                for text in batch.column(0).to_pylist():
                    yield text or "", True
        return
    with fsspec.open(url, "rt", encoding="utf-8", compression="infer") as f:
        if kind == "text":
            while piece := f.read(TEXT_PIECE_CHARS):
                piece += f.readline()  # pieces end at line ends
                yield piece, False
            yield "", True
            return
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[text_field]
            except (ValueError, KeyError, TypeError) as e:
                raise PrepareError(f"{url} line {n} is not a JSON object with a string "
                                   f"field {text_field!r} ({type(e).__name__}: {e}); fix "
                                   f"the line or pass --field NAME") from None
            if not isinstance(text, str):
                raise PrepareError(f"{url} line {n}: field {text_field!r} is "
                                   f"{type(text).__name__}, not a string")
            yield text, True


class Tokenizer:
    """A tokenizer.json and its end-of-document token, with what the manifest records."""

    def __init__(self, url: str, eos: str = ""):
        from tokenizers import Tokenizer as HFTokenizer
        try:
            with fsspec.open(url, "rb") as f:
                raw = f.read()
            self.tok = HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
            raise PrepareError(f"--tokenizer {url}: not a readable Hugging Face "
                               f"tokenizer.json ({type(e).__name__}: {e})") from None
        self.json = raw.decode("utf-8")
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        names = (eos,) if eos else EOS_NAMES
        found = [(n, i) for n in names if (i := self.tok.token_to_id(n)) is not None]
        if not found:
            raise PrepareError(f"--tokenizer {url} has no end-of-document token "
                               f"{'named ' + repr(eos) if eos else 'among ' + str(EOS_NAMES)}; "
                               f"pass --eos TOKEN naming one of its tokens")
        self.eos, self.eos_id = found[0]

    def describe(self, url: str) -> dict:
        return {"url": url, "sha256": self.sha256, "vocab_size": self.vocab_size,
                "eos": self.eos, "eos_id": self.eos_id}


_worker: dict = {}  # the tokenizer and config of this worker process


def _init_worker(cfg: Config, tokenizer_json: str, eos_id: int) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per process
    fault_points.install(cfg.faults, 0)
    _worker.update(cfg=cfg, tok=HFTokenizer.from_str(tokenizer_json), eos_id=eos_id,
                   written=0)


def _encode(pieces: list[tuple[str, bool]]) -> np.ndarray:
    tok, eos = _worker["tok"], _worker["eos_id"]
    encodings = tok.encode_batch_fast([text for text, _ in pieces], add_special_tokens=False)
    ids = []
    for enc, (_, ends) in zip(encodings, pieces):
        ids += enc.ids
        if ends:
            ids.append(eos)
    return np.array(ids, dtype=np.uint32)


def _prepare_file(index: int, url: str) -> dict:
    """Tokenizes input ``index`` into its shards, writes its record; returns the record."""
    cfg: Config = _worker["cfg"]
    shards, pending, buffered, documents, max_id = [], [], 0, 0, 0
    chunks: list[np.ndarray] = []

    def flush(final: bool) -> None:
        nonlocal chunks
        tokens = np.concatenate(chunks) if chunks else np.empty(0, np.uint32)
        while len(tokens) >= cfg.shard_tokens or (final and len(tokens)):
            shard, tokens = tokens[:cfg.shard_tokens], tokens[cfg.shard_tokens:]
            name = f"{index:06d}-{len(shards):05d}.bin"
            _worker["written"] += 1
            fault_points.point("prepare_shard", _worker["written"])
            target = join(cfg.out, name)
            fs, path = fsspec.core.url_to_fs(target)
            if not fs.exists(path):  # a finished shard is never rewritten
                write_shard(target, shard)
            shards.append({"name": name, "tokens": len(shard)})
        chunks = [tokens]

    for text, ends in _documents(url, cfg.text_field):
        pending.append((text, ends))
        buffered += len(text)
        documents += ends
        if buffered >= BATCH_CHARS:
            chunks.append(_encode(pending))
            max_id = max(max_id, int(chunks[-1].max(initial=0)))
            pending, buffered = [], 0
            if sum(map(len, chunks)) >= cfg.shard_tokens:
                flush(final=False)
    if pending:
        chunks.append(_encode(pending))
        max_id = max(max_id, int(chunks[-1].max(initial=0)))
    flush(final=True)
    record = {"input": url, "documents": documents, "max_token_id": max_id,
              "shards": shards}
    write_atomic(join(cfg.out, PREPARE_DIR, f"{index:06d}.json"), json.dumps(record).encode())
    return record


def _read_json(url: str) -> dict | None:
    fs, path = fsspec.core.url_to_fs(url)
    try:
        return json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return None


def prepare(cfg: Config) -> dict:
    """Prepares (or finishes preparing) the corpus ``cfg`` describes; returns its manifest."""
    if cfg.shard_tokens < 2:
        raise PrepareError(f"--shard-tokens {cfg.shard_tokens}: a shard needs >= 2 tokens")
    files = expand_inputs(cfg.inputs)
    for f in files:
        _format(f)
    tok = Tokenizer(cfg.tokenizer, cfg.eos)
    job = {"inputs": files, "tokenizer": tok.describe(cfg.tokenizer),
           "text_field": cfg.text_field, "shard_tokens": cfg.shard_tokens}
    job_url = join(cfg.out, PREPARE_DIR, "job.json")
    started = _read_json(job_url)
    if started is not None and started != job:
        changed = sorted(k for k in job if job[k] != started.get(k))
        raise PrepareError(f"--out {cfg.out} holds a prepare with other {', '.join(changed)}; "
                           f"give a new --out, or delete {cfg.out} to start over")
    done = _read_json(join(cfg.out, CORPUS_MANIFEST))
    if started is None and done is not None:
        raise PrepareError(f"--out {cfg.out} already holds a corpus that this command did "
                           f"not write; give a new --out")
    if done is not None:
        log.info("llmtrain data prepare: %s is already prepared", cfg.out)
        return done
    if started is None:
        write_atomic(job_url, json.dumps(job).encode())

    records: dict[int, dict] = {}
    todo = []
    for i, url in enumerate(files):
        record = _read_json(join(cfg.out, PREPARE_DIR, f"{i:06d}.json"))
        if record is None:
            todo.append(i)
        else:
            records[i] = record
    progress = _Progress(len(files), len(records))
    init = (cfg, tok.json, tok.eos_id)
    workers = min(cfg.workers or os.cpu_count() or 1, max(1, len(todo)))
    if workers == 1:
        _init_worker(*init)
        for i in todo:
            records[i] = _prepare_file(i, files[i])
            progress.file_done(records[i])
    else:
        with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=init) as pool:
            futures = {pool.submit(_prepare_file, i, files[i]): i for i in todo}
            for future in as_completed(futures):
                records[futures[future]] = future.result()
                progress.file_done(records[futures[future]])
    ordered = [records[i] for i in range(len(files))]
    shards = [s for r in ordered for s in r["shards"]]
    # the corpus keeps its tokenizer: a model exported from it (`ckpt export --to hf`)
    # ships it, though the tokenizer's own URL may be gone by then
    write_atomic(join(cfg.out, TOKENIZER_FILE), tok.json.encode("utf-8"))
    manifest = {"format": "llmtrain-corpus-1",
                "tokenizer": {**job["tokenizer"], "file": TOKENIZER_FILE},
                "text_field": cfg.text_field,
                "tokens": sum(s["tokens"] for s in shards),
                "documents": sum(r["documents"] for r in ordered),
                "max_token_id": max((r["max_token_id"] for r in ordered), default=0),
                "inputs": [{"url": r["input"], "documents": r["documents"],
                            "shards": [s["name"] for s in r["shards"]]} for r in ordered],
                "shards": shards}
    write_atomic(join(cfg.out, CORPUS_MANIFEST), json.dumps(manifest, indent=1).encode())
    progress.finish(manifest)
    return manifest


class _Progress:
    """One line per finished file: how far, how many tokens, how fast."""

    def __init__(self, files: int, done: int):
        self.files, self.done, self.tokens, self.start = files, done, 0, time.monotonic()

    def file_done(self, record: dict) -> None:
        self.done += 1
        self.tokens += sum(s["tokens"] for s in record["shards"])
        rate = self.tokens / max(time.monotonic() - self.start, 1e-9)
        log.info(f"prepare: {self.done}/{self.files} files, {self.tokens:,} tokens, "
                 f"{rate:,.0f} tokens/s ({record['input']})")

    def finish(self, manifest: dict) -> None:
        log.info(f"prepare: done: {manifest['tokens']:,} tokens of {manifest['documents']:,} "
                 f"documents in {len(manifest['shards'])} shards")
