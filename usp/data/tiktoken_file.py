"""A tiktoken BPE file as Llama 3 ships it (`tokenizer.model`: one "<base64 token> <rank>" per
line), with Llama 3's split pattern and its 256 special tokens after the ranks (<|begin_of_text|>
= BOS, <|end_of_text|> = EOS): Llama 3's 128,000 ranks give its 128,256 ids.

The file is parsed here, not by tiktoken.load.load_tiktoken_bpe: that one keeps a copy of every
file it reads in a temp cache keyed by the path, so an edited file at the same path would load
stale. `tiktoken` itself is imported only to encode (it is optional: `pip install tiktoken`)."""
from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterable
from pathlib import Path

from usp.data.data_error import DataError
from usp.data.tokenizer_base import TextTokenizer

TIKTOKEN_META = "tiktoken.json"  # in a prepared dataset: pattern and special tokens
TIKTOKEN_FILE = "tokenizer.model"
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
N_SPECIAL = 256
LLAMA3_NAMED = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def llama3_special_tokens(n_ranks: int) -> dict[str, int]:
    names = LLAMA3_NAMED + [f"<|reserved_special_token_{2 + i}|>" for i in range(N_SPECIAL - len(LLAMA3_NAMED))]
    return {name: n_ranks + i for i, name in enumerate(names)}


def read_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:
                raise DataError(f"data.tokenizer_path={str(path)!r} line {number} is not '<base64 token> <rank>':"
                                " not a tiktoken BPE file") from None
    if not ranks:
        raise DataError(f"data.tokenizer_path={str(path)!r} holds no tokens")
    return ranks


def tiktoken_vocab_size(path: Path) -> int:
    """Ranks + the 256 special tokens, from the number of lines (for `usp plan`: nothing decoded)."""
    with open(path, "rb") as f:
        n_ranks = sum(1 for line in f if line.strip())
    return n_ranks + N_SPECIAL


class TiktokenTokenizer(TextTokenizer):
    kind = "tiktoken"

    def __init__(self, path: Path, ranks: dict[bytes, int]) -> None:
        try:
            import tiktoken
        except ImportError:
            raise DataError("data.tokenizer=tiktoken needs the tiktoken package: pip install tiktoken") from None
        self.path = path
        specials = llama3_special_tokens(max(ranks.values()) + 1)
        self.enc = tiktoken.Encoding(path.stem, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                     special_tokens=specials)
        self.vocab_size = self.enc.n_vocab
        self.bos, self.eos = BOS, EOS
        self.bos_id, self.eos_id = specials[BOS], specials[EOS]

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)  # special-token text is encoded as plain text

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self.enc.decode([int(i) for i in ids])

    def save(self, directory: str | Path) -> Path:
        target = Path(directory, TIKTOKEN_FILE)
        shutil.copyfile(self.path, target)
        meta = {"kind": "tiktoken", "file": TIKTOKEN_FILE, "pattern": LLAMA3_PATTERN, "n_special": N_SPECIAL,
                "bos_token": BOS, "eos_token": EOS}
        Path(directory, TIKTOKEN_META).write_text(json.dumps(meta, indent=2) + "\n")
        return target


def hf_tokenizer_json(ranks: dict[bytes, int]) -> str:
    """The same tokenizer as a Hugging Face tokenizer.json (what transformers loads; Llama 3's own
    repositories ship one beside tokenizer.model), built by transformers' TikTokenConverter: byte-level
    BPE over GPT-2's byte map, merges in rank order, Llama 3's split pattern, the special tokens
    numbered after the ranks. That converter is what transformers' convert_tiktoken_to_fast runs after
    it copies the file (with blobfile, a package usp has no other use for); here it gets the ranks
    read_ranks read."""
    try:
        from transformers.convert_slow_tokenizer import TikTokenConverter
    except ImportError:
        raise DataError("a tiktoken tokenizer is written as tokenizer.json by transformers: "
                        "pip install 'usp[hf]' (or transformers)") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError("the tiktoken file's ranks are not 0..n-1: its special token ids have no Hugging Face "
                        "equivalent")

    class FromRanks(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            # tiktoken's own loader would read the file again and keep a copy in a temp cache keyed by its path
            return ranks

    converter = FromRanks(pattern=LLAMA3_PATTERN, extra_special_tokens=llama3_special_tokens(len(ranks)))
    return converter.converted().to_str()


def tiktoken_from_file(path: Path) -> TiktokenTokenizer:
    return TiktokenTokenizer(path, read_ranks(path))


def load_tiktoken(directory: str | Path) -> TiktokenTokenizer:
    return tiktoken_from_file(Path(directory, TIKTOKEN_FILE))
