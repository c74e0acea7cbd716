"""Data that isn't text (usp/data/text_check.py): a Latin-1 file, random bytes, an ELF binary and an
unknown extension in data.paths, prepared for real (`usp prepare-data` and `usp train` as a user
runs them, the bytes tokenizer: no training time). Refused naming the file, what is wrong (the byte
offset of invalid UTF-8) and data.text_check; skip leaves them out; off reads them as before."""
from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from tests.data_builders import WORDS, word_corpus
from tests.helpers import usp_cli
from usp.contract.config_schema import DataConfig
from usp.data.data_error import DataError
from usp.data.text_check import CHUNK_BYTES, file_problem
from usp.data.tokenized import ensure_dataset, fingerprint

LATIN = "Le café du théâtre, où l'on parle français.\n"


def _corpus(root: Path) -> Path:
    """A directory of good text files and one of each bad kind."""
    data = root / "data"
    data.mkdir()
    for i in range(2):
        (data / f"good{i}.txt").write_text(word_corpus(8_000, WORDS, i))
    (data / "latin1.txt").write_bytes(("plain first line\n" + LATIN * 20).encode("latin-1"))
    (data / "random.txt").write_bytes(random.Random(0).randbytes(4096))
    shutil.copy("/bin/true", data / "program")  # an ELF binary, no extension
    return data


def _cfg(root: Path, **kw) -> DataConfig:
    return DataConfig(name="text_files", source="text_files", paths=[str(root / "data")], tokenizer="bytes",
                      val_fraction=0.3, cache_dir=str(root / "cache"), **kw)


def _prepare(root: Path, *overrides: str):
    return usp_cli("prepare-data", "data=text_files", f"data.paths=[{root / 'data'}]", "data.tokenizer=bytes",
                   "data.val_fraction=0.3", f"data.cache_dir={root / 'cache'}", *overrides, cwd=root)


def test_latin1_random_bytes_and_a_binary_are_refused_naming_each_file(tmp_path):
    data = _corpus(tmp_path)
    r = _prepare(tmp_path)
    error = " ".join(r.stderr.split())  # rich wraps long lines
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "data.paths: 3 file(s) are not UTF-8 text" in error
    offset = len("plain first line\nLe caf")  # the first é, in Latin-1 one byte 0xe9
    assert f"{data / 'latin1.txt'}: not valid UTF-8: byte 0xe9 at offset {offset} (line 2)" in error
    assert f"{data / 'random.txt'}: binary: a NUL byte at offset" in error
    assert f"{data / 'program'}: binary: a NUL byte at offset" in error
    assert "good0.txt" not in error
    assert "fix: data.text_check=skip leaves such files out" in error and "data.text_check=off" in error
    datasets = tmp_path / "cache" / "datasets"
    assert not datasets.exists() or not any(datasets.iterdir())  # nothing prepared, nothing half-written


def test_skip_leaves_them_out_with_a_warning_each(tmp_path):
    data = _corpus(tmp_path)
    r = _prepare(tmp_path, "data.text_check=skip")
    out = " ".join(r.stdout.split())
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("latin1.txt", "random.txt", "program"):
        assert f"warning: data.paths: left out {data / name}:" in out
    good = sum((data / f"good{i}.txt").stat().st_size for i in range(2))
    directory, meta = ensure_dataset(_cfg(tmp_path, text_check="skip"), warn=pytest.fail)  # the one just prepared
    assert meta["n_files"] == 2 and meta["n_bytes"] == good


def test_off_reads_every_file_as_text_as_before(tmp_path):
    _corpus(tmp_path)
    directory, meta = ensure_dataset(_cfg(tmp_path, text_check="off"), warn=pytest.fail)
    assert meta["n_files"] == 5
    assert fingerprint(_cfg(tmp_path, text_check="off")) != fingerprint(_cfg(tmp_path))  # not strict's dataset


def test_an_unknown_extension_is_read_as_text_with_a_warning(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "book.txt").write_text(word_corpus(8_000, WORDS, 0))
    (data / "notes.weird").write_text(word_corpus(8_000, WORDS, 1))
    warnings: list[str] = []
    _, meta = ensure_dataset(_cfg(tmp_path), warn=warnings.append)
    assert meta["n_files"] == 2
    assert len(warnings) == 1 and f"{data / 'notes.weird'}: an extension the text reader doesn't know" in warnings[0]
    assert "book.txt" not in warnings[0] and "data.text_check=off" in warnings[0]


def test_an_unknown_text_check_is_refused(tmp_path):
    _corpus(tmp_path)
    with pytest.raises(DataError, match="data.text_check='maybe' is not one of strict, skip, off"):
        ensure_dataset(_cfg(tmp_path, text_check="maybe"))


def test_the_offset_is_exact_across_read_chunks(tmp_path):
    """A character split by the read's chunk boundary is fine; a bad byte after it is named at its offset."""
    head = b"a" * (CHUNK_BYTES - 1) + "é".encode()  # its two bytes straddle the boundary
    path = tmp_path / "big.txt"
    path.write_bytes(head + b"\nok\n")
    assert file_problem(path) is None
    path.write_bytes(head + b"\nok\n\xff")
    problem = file_problem(path)
    assert problem is not None and f"byte 0xff at offset {len(head) + 4:,} (line 3)" in problem.what
    path.write_bytes(b"fine\n" + "é".encode()[:1])  # cut inside a character
    assert "ends inside a character" in file_problem(path).what


def test_control_bytes_make_a_file_binary_without_nul(tmp_path):
    path = tmp_path / "ctl.txt"
    path.write_bytes(bytes(random.Random(1).choice(range(1, 9)) for _ in range(2000)) + b"text\n" * 100)
    assert "control bytes" in file_problem(path).what
    path.write_bytes(b"a form feed \x0c and an escape \x1b[1m are text\n" * 100)
    assert file_problem(path) is None


def test_a_train_refused_for_its_data_leaves_no_run_directory(tmp_path):
    """`usp train` stops at the data stage: no runs/<name>/ (nor an empty checkpoints/ in it) that
    `usp status` would list as a stopped run."""
    _corpus(tmp_path)
    r = usp_cli("train", "model=tiny", "data=text_files", f"data.paths=[{tmp_path / 'data'}]",
                "data.tokenizer=bytes", f"data.cache_dir={tmp_path / 'cache'}", f"train.runs_dir={tmp_path / 'runs'}",
                "train.name=bad_data", cwd=tmp_path)
    assert r.returncode == 2 and "are not UTF-8 text" in " ".join(r.stderr.split()), r.stdout + r.stderr
    assert not (tmp_path / "runs" / "bad_data").exists()
