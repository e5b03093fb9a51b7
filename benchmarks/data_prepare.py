"""``llmtrain data prepare`` throughput per core against the tokenizer's own speed.

The text is the Python stdlib's sources (nothing downloaded), split into documents at
blank lines and written as ``--files`` JSONL files; the tokenizer is a byte-level BPE of
``--vocab`` tokens trained on it here. Both sides run on one core
(``TOKENIZERS_PARALLELISM=false``; prepare with one worker):

- **baseline**: ``Tokenizer.encode_batch_fast`` over the same documents, in memory: the
  call prepare makes (ids only, no character offsets); ``encode_batch``, which also
  computes the offsets, for reference;
- **prepare**: the whole command's work: read and parse the JSONL, tokenize, append EOS,
  write the shards and the manifest, into a fresh directory each time.

Each side's best of ``--repeats``, alternating. Goal: prepare >= 0.8x encode_batch_fast.

    python benchmarks/data_prepare.py [--mb 8] [--files 4] [--vocab 8192] [--repeats 3]

Prints a table, then one JSON line of the figures.
"""

from __future__ import annotations

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers is imported: one core

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from llmtrain.data import _stdlib_bytes  # noqa: E402
from llmtrain.data.prepare import Config, prepare  # noqa: E402
from reaper import reaping  # noqa: E402

EOS = "<|endoftext|>"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=8.0, help="megabytes of text")
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    text = _stdlib_bytes(int(args.mb * 1e6)).decode("utf-8", errors="replace")
    docs = [d for d in text.replace("\0", "\n\n").split("\n\n") if d.strip()]
    work = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    try:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(docs, trainers.BpeTrainer(
            vocab_size=args.vocab, special_tokens=[EOS], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tok.save(str(work / "tokenizer.json"))
        per_file = -(-len(docs) // args.files)
        inputs = []
        for i in range(args.files):
            path = work / f"{i}.jsonl"
            path.write_text("".join(json.dumps({"text": d}) + "\n"
                                    for d in docs[i * per_file:(i + 1) * per_file]))
            inputs.append(str(path))

        best = {"encode_batch_fast": float("inf"), "encode_batch": float("inf"),
                "prepare": float("inf")}
        tokens = {}
        for r in range(args.repeats):
            t0 = time.perf_counter()
            encodings = tok.encode_batch_fast(docs, add_special_tokens=False)
            best["encode_batch_fast"] = min(best["encode_batch_fast"], time.perf_counter() - t0)
            tokens["encode_batch_fast"] = sum(len(e.ids) for e in encodings) + len(docs)  # EOS
            del encodings
            t0 = time.perf_counter()
            tok.encode_batch(docs, add_special_tokens=False)
            best["encode_batch"] = min(best["encode_batch"], time.perf_counter() - t0)
            out = work / f"out-{r}"
            t0 = time.perf_counter()
            manifest = prepare(Config(inputs=inputs, tokenizer=str(work / "tokenizer.json"),
                                      out=str(out), workers=1))
            best["prepare"] = min(best["prepare"], time.perf_counter() - t0)
            tokens["prepare"] = manifest["tokens"]
            shutil.rmtree(out)
        assert tokens["prepare"] == tokens["encode_batch_fast"], tokens  # the same work
        n = tokens["prepare"]
        rates = {k: n / v for k, v in best.items()}
        print(f"\n{len(text) / 1e6:.1f} MB of text, {len(docs):,} documents, {n:,} tokens "
              f"(vocab {args.vocab}), one core, best of {args.repeats}")
        print(f"{'side':<20} {'seconds':>8} {'tokens/s':>12} {'vs encode_batch_fast':>21}")
        for k, v in best.items():
            print(f"{k:<20} {v:>8.2f} {rates[k]:>12,.0f} "
                  f"{rates[k] / rates['encode_batch_fast']:>20.2f}x")
        figures = {"tokens": n, "documents": len(docs), "text_mb": len(text) / 1e6,
                   "vocab": args.vocab,
                   "prepare_tokens_per_s_per_core": rates["prepare"],
                   "encode_batch_tokens_per_s": rates["encode_batch"],
                   "encode_batch_fast_tokens_per_s": rates["encode_batch_fast"],
                   "ratio_vs_encode_batch": rates["prepare"] / rates["encode_batch"],
                   "ratio_vs_encode_batch_fast": rates["prepare"] / rates["encode_batch_fast"],
                   "goal_ratio_0_8_met": rates["prepare"] / rates["encode_batch_fast"] >= 0.8}
        print(json.dumps(figures))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    with reaping():
        main()
