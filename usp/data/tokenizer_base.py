"""The interface every tokenizer kind implements (usp/data/tokenizer.py, usp/data/tiktoken_file.py)."""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

BYTES_DOC_END = "\n\n"  # ends a document when the tokenizer has no EOS id (bytes)


class TextTokenizer:
    """encode / encode_batch / decode / save, and the special ids a document is framed with."""

    kind: str
    vocab_size: int  # max id + 1: the embedding rows the model needs
    bos_id: int | None = None
    eos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def save(self, directory: str | Path) -> Path:
        raise NotImplementedError

    def doc_end(self) -> list[int]:
        """The ids that end every document."""
        return [self.eos_id] if self.eos_id is not None else self.encode(BYTES_DOC_END)

    def special_tokens(self) -> dict[str, Any]:
        return {"bos_id": self.bos_id, "eos_id": self.eos_id, "doc_end": self.doc_end()}
