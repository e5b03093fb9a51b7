"""A small byte-level BPE tokenizer trained here, on the embedded corpus: nothing downloaded."""

from __future__ import annotations

from pathlib import Path

from llmtrain.data import _stdlib_bytes

EOS = "<|endoftext|>"


def corpus_text(max_bytes: int) -> str:
    """Python sources of the stdlib, as text; NUL (the byte tokenizer's EOS) ends each."""
    return _stdlib_bytes(max_bytes).decode("utf-8", errors="replace")


def documents(n: int, max_bytes: int = 200_000) -> list[str]:
    """``n`` documents: the paragraphs (blank-line separated) of stdlib sources."""
    return [d for d in corpus_text(max_bytes).replace("\0", "\n\n").split("\n\n")
            if d.strip()][:n]


def train_bpe(path: Path, vocab_size: int = 512, max_bytes: int = 300_000) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus_text(max_bytes).split("\0"), trainer)
    tok.save(str(path))
    return path
