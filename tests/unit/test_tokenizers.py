"""Pretrained tokenizers from a local path (HF tokenizer.json / directory, a tiktoken BPE file),
built in the tests; how documents are framed (BOS, EOS) (vocabularies over 65,536:
tests/engine/test_tokenizers.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.data_builders import WORDS, big_wordlevel_tokenizer, hf_bpe_tokenizer, tiktoken_file, word_corpus
from tests.helpers import usp_cli
from usp.contract.config_schema import DataConfig
from usp.data.data_error import DataError
from usp.data.tokenized import ensure_dataset
from usp.data.tokenizer import load_tokenizer

DOCS = [word_corpus(10_000, WORDS, seed) for seed in range(3)]


def _corpus(tmp_path: Path) -> list[str]:
    paths = []
    for i, text in enumerate(DOCS):
        (tmp_path / f"doc{i}.txt").write_text(text)
        paths.append(str(tmp_path / f"doc{i}.txt"))
    return paths


def _cfg(tmp_path: Path, **kw) -> DataConfig:
    return DataConfig(name="pre", source="text_files", paths=_corpus(tmp_path), val_fraction=0.3,
                      cache_dir=str(tmp_path / "cache"), **kw)


def _documents(tokens: np.ndarray, eos: int) -> list[list[int]]:
    ends = np.flatnonzero(tokens == eos)
    return [tokens[a + 1: b].tolist() for a, b in zip(np.r_[-1, ends[:-1]], ends)]


def test_hf_tokenizer_directory_frames_documents_with_bos_and_eos(tmp_path):
    from tokenizers import Tokenizer

    path = hf_bpe_tokenizer(tmp_path / "tok", DOCS)
    cfg = _cfg(tmp_path, tokenizer="hf", tokenizer_path=str(tmp_path / "tok"), add_bos=True)
    directory, meta = ensure_dataset(cfg)
    assert (meta["tokenizer"], meta["vocab_size"], meta["dtype"], meta["bos_id"], meta["eos_id"]) == \
        ("hf", Tokenizer.from_file(str(path)).get_vocab_size(), "uint16", 0, 1)
    tokens = np.concatenate([np.fromfile(directory / meta[k], dtype=np.uint16) for k in ("train_bin", "val_bin")])
    tok = load_tokenizer(directory)  # the dataset keeps its tokenizer (and BOS/EOS names)
    assert (tok.kind, tok.bos_id, tok.eos_id) == ("hf", 0, 1)
    docs = _documents(tokens, eos=1)
    assert len(docs) == 3 and tokens[-1] == 1
    for ids, text in zip(docs, DOCS):  # [BOS] text [EOS]: one BOS, not two (the file's template is off)
        assert ids[0] == 0 and 0 not in ids[1:] and tok.decode(ids[1:]) == text


def test_hf_tokenizer_json_alone_finds_eos_by_name(tmp_path):
    path = hf_bpe_tokenizer(tmp_path / "tok", DOCS, config=False)
    directory, meta = ensure_dataset(_cfg(tmp_path, tokenizer="hf", tokenizer_path=str(path)))
    assert (meta["bos_id"], meta["eos_id"], meta["add_bos"]) == (0, 1, False)  # <s>, </s> by their names
    train = np.fromfile(directory / meta["train_bin"], dtype=np.uint16)
    assert train[0] != 0 and (train == 1).sum() >= 1


def test_tiktoken_file_llama3_style(tmp_path):
    path = tiktoken_file(tmp_path / "tokenizer.model")
    cfg = _cfg(tmp_path, tokenizer="tiktoken", tokenizer_path=str(path), add_bos=True)
    directory, meta = ensure_dataset(cfg)
    n_ranks = 256 + 7
    assert (meta["vocab_size"], meta["bos_id"], meta["eos_id"]) == (n_ranks + 256, n_ranks, n_ranks + 1)
    tok = load_tokenizer(directory)
    assert tok.kind == "tiktoken" and tok.encode("the") == [258] and tok.encode(" the") == [260]
    assert tok.decode(tok.encode("the theatre — ok")) == "the theatre — ok"
    assert tok.encode("<|end_of_text|>") != [n_ranks + 1]  # special-token text in a document is plain text
    tokens = np.concatenate([np.fromfile(directory / meta[k], dtype=np.uint16) for k in ("train_bin", "val_bin")])
    docs = _documents(tokens, eos=n_ranks + 1)
    assert [tok.decode(d[1:]) for d in docs] == DOCS and all(d[0] == n_ranks for d in docs)


@pytest.mark.parametrize("kind,setup,words", [
    ("hf", lambda p: None, r"data\.tokenizer=hf needs data\.tokenizer_path"),
    ("hf", lambda p: (p / "empty").mkdir(), r"data\.tokenizer_path=.*empty.*holds no tokenizer\.json"),
    ("hf", lambda p: (p / "x.json").write_text("{}"),
     r"data\.tokenizer_path=.*x\.json.*can.t be loaded by .tokenizers."),
    ("tiktoken", lambda p: (p / "x.model").write_text("dGhl 0\nnot base64!\n"),
     r"data\.tokenizer_path=.*line 2 is not '<base64 token> <rank>'"),
])
def test_bad_tokenizer_paths_name_the_key_and_leave_nothing(tmp_path, kind, setup, words):
    setup(tmp_path)
    target = {"empty": "empty", "x.json": "x.json", "x.model": "x.model"}
    existing = [p for p in tmp_path.iterdir() if p.name in target]
    cfg = _cfg(tmp_path, tokenizer=kind, tokenizer_path=str(existing[0]) if existing else None)
    with pytest.raises(DataError, match=words):
        ensure_dataset(cfg)
    assert not (tmp_path / "cache" / "datasets").exists() or not any((tmp_path / "cache" / "datasets").iterdir())


def test_a_tokenizer_without_eos_is_refused(tmp_path):
    path, _ = big_wordlevel_tokenizer(tmp_path / "tok", n_words=300)
    text = path.read_text().replace('"</s>"', '"<sep>"')  # no end-of-document token left
    path.write_text(text)
    with pytest.raises(DataError, match=r"no end-of-document token.*set data\.eos_token"):
        ensure_dataset(_cfg(tmp_path, tokenizer="hf", tokenizer_path=str(path)))
    directory, meta = ensure_dataset(_cfg(tmp_path, tokenizer="hf", tokenizer_path=str(path), eos_token="<sep>"))
    assert meta["eos_id"] == 1


def test_plan_takes_the_vocab_from_the_tokenizer_file(tmp_path):
    path = tiktoken_file(tmp_path / "tokenizer.model")
    _corpus(tmp_path)
    args = ["data=text_files", f"data.paths=[{tmp_path}/*.txt]", "data.tokenizer=tiktoken",
            f"data.tokenizer_path={path}"]
    r = usp_cli("plan", *args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "vocab 519" in r.stdout
    r = usp_cli("plan", *args, "model.vocab_size=500", cwd=tmp_path)
    assert r.returncode == 2 and "model.vocab_size=500" in r.stderr and "519" in r.stderr
    assert not (tmp_path / "cache").exists()  # refused before anything was tokenized
