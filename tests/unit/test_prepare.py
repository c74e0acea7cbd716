"""Preparation of own files: validation by documents, shards tokenized in parallel and cached (only
changed files again, an interrupted prepare continues), the trained BPE reused, `usp prepare-data
--clean` (HF-datasets records: tests/engine/test_prepare.py; bounded memory: tests/e2e/test_prepare.py)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tests.data_builders import WORDS, word_corpus
from tests.helpers import usp_cli
from usp.contract.config_schema import DataConfig
from usp.data.data_error import DataError
from usp.data.tokenized import dataset_dir, ensure_dataset, val_split


def _files(directory: Path, n: int, words: int = 3000) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        paths.append(directory / f"part{i:02d}.txt")
        paths[-1].write_text(word_corpus(words, WORDS, seed=i))
    return paths


def _cfg(tmp_path: Path, **kw) -> DataConfig:
    base = dict(name="corpus", source="files", paths=[str(tmp_path / "corpus")], tokenizer="bytes",
                val_fraction=0.2, cache_dir=str(tmp_path / "cache"), workers=2)
    return DataConfig(**{**base, **kw})


def _shards(tmp_path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache" / "shards").glob("*.bin")}


def test_val_split_is_whole_tail_documents_when_it_can_be():
    assert val_split(np.array([10, 10, 10, 10]), 0.2) == (30, "documents")
    assert val_split(np.array([40, 30, 20, 10]), 0.15) == (70, "documents")  # 2 tail docs: 30 >= 15
    assert val_split(np.array([100]), 0.1) == (90, "tokens")  # one document: split inside it
    assert val_split(np.array([10, 90]), 0.05) == (95, "tokens")  # the tail document is far over the share


def test_only_changed_files_are_tokenized_again_and_clean_removes_the_old(tmp_path):
    files = _files(tmp_path / "corpus", 6)
    messages: list[str] = []
    first_dir, first = ensure_dataset(_cfg(tmp_path), progress=messages.append)
    assert any("tokenizing 6 of 6 files" in m and "2 processes" in m for m in messages)
    before = _shards(tmp_path)
    files[3].write_text(word_corpus(3000, WORDS, seed=99))  # one file edited
    os.utime(files[4])  # one only touched: its mtime changed, so it is read again (cheap and safe)
    messages.clear()
    second_dir, second = ensure_dataset(_cfg(tmp_path), progress=messages.append)
    assert second_dir != first_dir and any("tokenizing 2 of 6 files" in m for m in messages)
    after = _shards(tmp_path)
    assert len(set(after) - set(before)) == 2 and all(after[k] == before[k] for k in set(before) & set(after))

    r = usp_cli("prepare-data", "data=files", f"data.paths=[{tmp_path / 'corpus'}]", "data.tokenizer=bytes",
                "data.name=corpus", "data.val_fraction=0.2", f"data.cache_dir={tmp_path / 'cache'}", "--clean",
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # the old dataset, and the 2 shards only it used (tokens, document lengths, meta: 3 files each)
    assert "removed 7 stale cache entries" in r.stdout
    assert not first_dir.exists() and second_dir.exists()
    remaining = set(_shards(tmp_path))
    assert len(remaining) == 6 and set(after) - set(before) <= remaining
    assert ensure_dataset(_cfg(tmp_path)) == (second_dir, second)  # still ready, nothing rebuilt


def test_an_interrupted_prepare_continues_where_it_stopped(tmp_path):
    """A file that can't be read stops the prepare after the others were tokenized (one worker,
    sorted order: it is last); nothing half-written stays, and the next run tokenizes only it."""
    _files(tmp_path / "corpus", 4)
    broken = tmp_path / "corpus" / "zz.parquet"
    broken.write_bytes(b"PAR1 truncated PAR1")
    cfg = _cfg(tmp_path, workers=1)
    pytest.importorskip("datasets")
    with pytest.raises(DataError, match=r"zz\.parquet can't be read as parquet"):
        ensure_dataset(cfg)
    assert len(_shards(tmp_path)) == 4 and not dataset_dir(cfg).exists()
    assert not [p for p in (tmp_path / "cache").rglob("*") if ".tmp-" in p.name]
    broken.unlink()
    messages: list[str] = []
    ensure_dataset(cfg, progress=messages.append)
    assert not any("tokenizing" in m for m in messages)  # every file was already done
    # a killed prepare leaves temp files behind: --clean removes them
    (tmp_path / "cache" / "shards" / "abc.bin.tmp-123").write_bytes(b"x")
    (tmp_path / "cache" / "datasets" / ".corpus-x.tmp-1").mkdir()
    from usp.data.clean import clean_caches

    removed = clean_caches(cfg, keep=dataset_dir(cfg))
    assert {p.name for p in removed} == {"abc.bin.tmp-123", ".corpus-x.tmp-1"}


def test_the_trained_bpe_is_reused_not_retrained(tmp_path):
    files = _files(tmp_path / "corpus", 3, words=20_000)
    messages: list[str] = []
    cfg = _cfg(tmp_path, tokenizer="bpe", vocab_size=300, workers=1)
    first_dir, _ = ensure_dataset(cfg, progress=messages.append)
    assert sum("training BPE" in m for m in messages) == 1
    messages.clear()
    files[0].write_text(word_corpus(20_000, WORDS, seed=50))
    second_dir, _ = ensure_dataset(_cfg(tmp_path, tokenizer="bpe", vocab_size=300, workers=1, val_fraction=0.3),
                                   progress=messages.append)
    assert not any("training BPE" in m for m in messages) and any("tokenizing 1 of 3" in m for m in messages)
    assert (first_dir / "tokenizer.json").read_bytes() == (second_dir / "tokenizer.json").read_bytes()


def test_progress_bar_and_parallel_workers_give_the_same_tokens(tmp_path):
    _files(tmp_path / "corpus", 5)
    one_dir, one = ensure_dataset(_cfg(tmp_path, workers=1, cache_dir=str(tmp_path / "c1")))
    two_dir, two = ensure_dataset(_cfg(tmp_path, workers=2, cache_dir=str(tmp_path / "c2")), show_progress=True)
    for key in ("train_bin", "val_bin"):
        assert (one_dir / one[key]).read_bytes() == (two_dir / two[key]).read_bytes()
