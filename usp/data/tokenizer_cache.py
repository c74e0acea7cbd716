"""The tokenizer a prepare uses: bytes, a pretrained one from data.tokenizer_path, or the trained
BPE, trained once per corpus and vocabulary and kept under <cache>/tokenizers/bpe-<key>/ (not
retrained by every prepare: a new or edited file is tokenized with the tokenizer already there).
The BPE is trained on a stream of the corpus's text (the trainer keeps word counts, not text)."""
from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from usp.data.corpus import unit_pieces
from usp.data.tokenizer import (
    PRETRAINED,
    ByteTokenizer,
    TextTokenizer,
    load_pretrained,
    load_tokenizer,
    train_tokenizer,
)


def resolve_tokenizer(data_cfg: Any, comps: list, identity: dict[str, Any], cache_base: Path,
                      say: Callable[[str], None]) -> TextTokenizer:
    kind = identity["kind"]
    if kind in PRETRAINED:
        return load_pretrained(data_cfg)
    if kind == "bytes":
        return ByteTokenizer()
    target = cache_base / "tokenizers" / f"bpe-{identity['bpe']}"
    if (target / "tokenizer.json").is_file():
        return load_tokenizer(target)
    vocab_size = int(getattr(data_cfg, "vocab_size", 4096))
    say(f"training BPE tokenizer (vocab {vocab_size}) on {sum(len(c.units) for c in comps)} files")
    tokenizer = train_tokenizer(_texts(comps), "bpe", vocab_size)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tokenizer.save(tmp)
        try:
            tmp.rename(target)  # atomic; a concurrent prepare that trained the same one wins
        except OSError:
            if not (target / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return load_tokenizer(target)


def _texts(comps: list) -> Iterator[str]:
    for comp in comps:
        for unit in comp.units:
            for _, piece in unit_pieces(unit):
                yield piece
