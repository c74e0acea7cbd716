"""Tokenizers and corpora built on the spot for the data tests (nothing downloaded)."""
from __future__ import annotations

import base64
import json
from pathlib import Path

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "runs", "away", "home"]


def hf_bpe_tokenizer(directory: Path, texts: list[str], vocab_size: int = 400, config: bool = True) -> Path:
    """A byte-level BPE with <s> / </s>, saved as an HF tokenizer directory (tokenizer.json and,
    with `config`, a tokenizer_config.json naming BOS and EOS); returns the tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    hf.train_from_iterator(texts, trainer=trainer)
    # Like Llama's: encode() adds BOS on its own; usp must not let that template into the files.
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    directory.mkdir(parents=True, exist_ok=True)
    hf.save(str(directory / "tokenizer.json"))
    if config:
        config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}  # both spellings HF uses
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory / "tokenizer.json"


def big_wordlevel_tokenizer(directory: Path, n_words: int = 70_000) -> tuple[Path, list[str]]:
    """A word-level tokenizer with more than 65,536 ids (uint32 token files): [UNK], </s>, w0 .. ;
    returns the tokenizer.json and its words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = [f"w{i}" for i in range(n_words)]
    vocab = {"[UNK]": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.decoder = decoders.WordPiece()
    hf.add_special_tokens(["</s>"])
    directory.mkdir(parents=True, exist_ok=True)
    hf.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json", words


MERGES = (b"th", b"he", b"the", b" t", b" the", b"er", b"ing")


def tiktoken_file(path: Path, merges: tuple[bytes, ...] = MERGES) -> Path:
    """A Llama-3-style tiktoken BPE file: the 256 bytes, then `merges`, one '<base64> <rank>' a line."""
    tokens = [bytes([b]) for b in range(256)] + list(merges)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return path


def trained_tiktoken_file(path: Path, texts: list[str], n_merges: int = 300) -> Path:
    """A tiktoken BPE file learnt here from `texts` the way such files are made: the 256 bytes, then
    the most frequent adjacent pair of tokens merged into a new token, n_merges times (pairs counted
    within words, a word keeping its leading space)."""
    import re
    from collections import Counter

    words = Counter(w.encode() for text in texts for w in re.findall(r" ?\w+| ?[^\w\s]+|\s+", text))
    pieces = {w: [bytes([b]) for b in w] for w in words}
    tokens = [bytes([b]) for b in range(256)]
    known = set(tokens)
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for word, seq in pieces.items():
            for pair in zip(seq, seq[1:]):
                pairs[pair] += words[word]
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        if a + b not in known:
            tokens.append(a + b)
            known.add(a + b)
        for word, seq in pieces.items():
            merged, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and (seq[i], seq[i + 1]) == (a, b):
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(seq[i])
                    i += 1
            pieces[word] = merged
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return path


def word_corpus(n_words: int, words: list[str], seed: int = 0) -> str:
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(words) for _ in range(n_words))
