"""Tokenizers trained at prepare time: byte-level BPE (HF `tokenizers`) or raw UTF-8 bytes."""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from usp.data.errors import DataError

TOKENIZER_FILE = "tokenizer.json"
KINDS = ("bpe", "bytes")
BYTE_VOCAB = 256
MAX_VOCAB = 1 << 32  # token ids are stored as uint16 (vocab <= 65,536) or uint32


class TextTokenizer:
    """One interface over both kinds; `hf` is a `tokenizers.Tokenizer` for bpe, None for bytes."""

    def __init__(self, kind: str, hf: tokenizers.Tokenizer | None = None) -> None:  # noqa: F821
        self.kind = kind
        self.hf = hf
        self.vocab_size = hf.get_vocab_size() if hf is not None else BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        if self.hf is None:
            return list(text.encode("utf-8"))
        return self.hf.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self.hf is None:
            return [self.encode(t) for t in texts]
        # Parallel in Rust; the _fast variant (tokenizers >= 0.20) skips offsets, ~2x faster.
        encode = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)
        return [e.ids for e in encode(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if self.hf is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self.hf.decode(ids)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory, TOKENIZER_FILE)
        if self.hf is None:
            path.write_text(json.dumps({"kind": "bytes", "vocab_size": BYTE_VOCAB}) + "\n")
        else:
            self.hf.save(str(path))
        return path


def load_tokenizer(directory: str | Path) -> TextTokenizer:
    path = Path(directory, TOKENIZER_FILE)
    if json.loads(path.read_text()).get("kind") == "bytes":
        return TextTokenizer("bytes")
    from tokenizers import Tokenizer

    return TextTokenizer("bpe", Tokenizer.from_file(str(path)))


def check_tokenizer_config(kind: str, vocab_size: int) -> None:
    if kind not in KINDS:
        raise DataError(f"data.tokenizer={kind!r} is unknown; choose one of {', '.join(KINDS)}")
    if kind == "bpe" and not BYTE_VOCAB < vocab_size <= MAX_VOCAB:
        raise DataError(
            f"data.vocab_size={vocab_size}: byte-level BPE needs more than the {BYTE_VOCAB} byte tokens"
            f" and at most {MAX_VOCAB} (uint32 token ids); e.g. data.vocab_size=4096,"
            " or data.tokenizer=bytes"
        )


def train_tokenizer(texts: Iterable[str], kind: str, vocab_size: int) -> TextTokenizer:
    check_tokenizer_config(kind, vocab_size)
    if kind == "bytes":
        return TextTokenizer("bytes")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    # add_prefix_space=False keeps decode(encode(x)) == x byte for byte.
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return TextTokenizer("bpe", hf)
