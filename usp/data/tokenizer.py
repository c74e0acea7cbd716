"""Tokenizers, one interface over four kinds (data.tokenizer):

  bpe       byte-level BPE trained on the corpus at prepare time (the default), with one special
            token, <|endoftext|> (id 0), that ends every document;
  bytes     raw UTF-8 bytes (256 ids, no special token: documents end with a blank line);
  hf        a pretrained HF `tokenizers` tokenizer: data.tokenizer_path is a tokenizer.json or a
            directory holding one (and usually tokenizer_config.json, which names BOS and EOS);
  tiktoken  a tiktoken BPE file as Llama 3 ships it (usp/data/tiktoken_file.py).

Documents are stored as [BOS] + ids + [EOS]: BOS only with data.add_bos (and a tokenizer that has
one), EOS always (bytes: "\\n\\n"). Text is encoded without the tokenizer's own template
(add_special_tokens=False), so the special tokens in the files are exactly these.

Only `json` at module level: `usp plan` reads a pretrained tokenizer's vocabulary size from here."""
from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from usp.data.data_error import DataError
from usp.data.tokenizer_base import TextTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"  # HF's: names bos_token / eos_token
KINDS = ("bpe", "bytes", "hf", "tiktoken")
PRETRAINED = ("hf", "tiktoken")
BYTE_VOCAB = 256
MAX_VOCAB = 1 << 32  # token ids are stored as uint16 (vocab <= 65,536) or uint32
TRAINED_EOS = "<|endoftext|>"
# Looked for (in this order) when neither data.eos_token / data.bos_token nor tokenizer_config.json names one.
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>")


class ByteTokenizer(TextTokenizer):
    kind, vocab_size = "bytes", BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> Path:
        path = Path(directory, TOKENIZER_FILE)
        path.write_text(json.dumps({"kind": "bytes", "vocab_size": BYTE_VOCAB}) + "\n")
        return path


class HFTokenizer(TextTokenizer):
    """A `tokenizers.Tokenizer`: the trained BPE (kind bpe) or a pretrained one (kind hf)."""

    def __init__(self, kind: str, hf: Any, bos: str | None = None, eos: str | None = None) -> None:
        self.kind, self.hf = kind, hf
        vocab = hf.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        self.bos, self.eos = bos, eos
        self.bos_id = vocab.get(bos) if bos else None
        self.eos_id = vocab.get(eos) if eos else None

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # Parallel in Rust; the _fast variant (tokenizers >= 0.20) skips offsets, ~2x faster.
        encode = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode([int(i) for i in ids])

    def save(self, directory: str | Path) -> Path:
        path = Path(directory, TOKENIZER_FILE)
        self.hf.save(str(path))
        # What transformers' PreTrainedTokenizerFast needs beside tokenizer.json to know BOS/EOS.
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos, "eos_token": self.eos,
                  "usp_kind": self.kind}
        Path(directory, TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        return path


def load_tokenizer(directory: str | Path) -> TextTokenizer:
    """The tokenizer a prepared dataset was tokenized with."""
    from usp.data.tiktoken_file import TIKTOKEN_META, load_tiktoken

    if Path(directory, TIKTOKEN_META).is_file():
        return load_tiktoken(directory)
    path = Path(directory, TOKENIZER_FILE)
    data = json.loads(path.read_text())
    if data.get("kind") == "bytes":
        return ByteTokenizer()
    from tokenizers import Tokenizer

    names = _config_names(Path(directory, TOKENIZER_CONFIG))
    return HFTokenizer(names.get("kind") or "hf", Tokenizer.from_file(str(path)), names.get("bos"), names.get("eos"))


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
        return ByteTokenizer()
    if kind != "bpe":
        raise DataError(f"data.tokenizer={kind!r} is pretrained: it is loaded from data.tokenizer_path, not trained")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    # add_prefix_space=False keeps decode(encode(x)) == x byte for byte.
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[TRAINED_EOS],
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer("bpe", hf, None, TRAINED_EOS)


# --- pretrained tokenizers from a local path ----------------------------------------------------------

def tokenizer_path(data_cfg: Any) -> Path:
    """data.tokenizer_path, resolved; for hf the tokenizer.json itself (a directory holds one)."""
    kind = str(getattr(data_cfg, "tokenizer", "bpe"))
    value = getattr(data_cfg, "tokenizer_path", None)
    if not value:
        raise DataError(f"data.tokenizer={kind} needs data.tokenizer_path=<a local "
                        f"{'tokenizer.json or HF tokenizer directory' if kind == 'hf' else 'tiktoken BPE file'}>")
    path = Path(str(value)).expanduser().resolve()
    if kind == "hf" and path.is_dir():
        if not (path / TOKENIZER_FILE).is_file():
            raise DataError(f"data.tokenizer_path={value!r} holds no {TOKENIZER_FILE} (a slow, sentencepiece-only"
                            " tokenizer?): save it once as a fast tokenizer with transformers'"
                            " AutoTokenizer.from_pretrained(dir).save_pretrained(dir)")
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(f"data.tokenizer_path={value!r}: no such file ({path})")
    return path


def pretrained_vocab_size(data_cfg: Any) -> int:
    """The vocabulary of data.tokenizer_path, read without loading the tokenizer (for `usp plan`)."""
    path = tokenizer_path(data_cfg)
    stat = path.stat()
    return _vocab_of(str(getattr(data_cfg, "tokenizer", "")), path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _vocab_of(kind: str, path: Path, size: int, mtime_ns: int) -> int:  # size, mtime: the cache key
    if kind == "tiktoken":
        from usp.data.tiktoken_file import tiktoken_vocab_size

        return tiktoken_vocab_size(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        vocab = data["model"]["vocab"]
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))  # Unigram: a list
        ids += [t["id"] for t in data.get("added_tokens") or []]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"data.tokenizer_path={str(path)!r} is not an HF tokenizer.json ({exc!r})") from None
    return max(ids) + 1


def load_pretrained(data_cfg: Any) -> TextTokenizer:
    kind = str(getattr(data_cfg, "tokenizer", "bpe"))
    path = tokenizer_path(data_cfg)
    if kind == "tiktoken":
        from usp.data.tiktoken_file import tiktoken_from_file

        return tiktoken_from_file(path)
    from tokenizers import Tokenizer

    try:
        hf = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception
        raise DataError(f"data.tokenizer_path={str(path)!r} can't be loaded by `tokenizers`: {exc}") from None
    names = _config_names(path.parent / TOKENIZER_CONFIG)
    vocab = hf.get_vocab(with_added_tokens=True)
    eos = _special(data_cfg, "eos_token", names.get("eos"), EOS_NAMES, vocab)
    bos = _special(data_cfg, "bos_token", names.get("bos"), BOS_NAMES, vocab)
    if eos is None:
        raise DataError(f"data.tokenizer_path={str(path)!r}: no end-of-document token found (looked for"
                        f" {', '.join(EOS_NAMES)} and tokenizer_config.json's eos_token): set data.eos_token")
    return HFTokenizer("hf", hf, bos, eos)


def _config_names(path: Path) -> dict[str, Any]:
    """bos/eos token strings from an HF tokenizer_config.json (a string or {"content": ...})."""
    if not path.is_file():
        return {}
    config = json.loads(path.read_text(encoding="utf-8"))
    out: dict[str, Any] = {"kind": config.get("usp_kind")}
    for key in ("bos", "eos"):
        value = config.get(f"{key}_token")
        out[key] = value.get("content") if isinstance(value, dict) else value
    return out


def _special(data_cfg: Any, key: str, configured: str | None, names: tuple[str, ...],
             vocab: dict[str, int]) -> str | None:
    explicit = getattr(data_cfg, key, None)
    if explicit:
        if explicit not in vocab:
            raise DataError(f"data.{key}={explicit!r} is not a token of data.tokenizer_path")
        return str(explicit)
    if configured and configured in vocab:
        return configured
    return next((name for name in names if name in vocab), None)
