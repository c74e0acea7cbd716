"""`usp prepare-data` (and `usp train`) refuse token files whose ids don't fit data.vocab_size,
naming the file and the largest id, instead of an IndexError inside the embedding."""
from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import usp_cli
from usp.contract.config_schema import DataConfig
from usp.data import tokenized as prepare
from usp.data.data_error import DataError
from usp.data.tokenized import ensure_dataset


def _files(tmp_path, top: int):
    train = np.arange(1000, dtype=np.uint16) % 100
    train[777] = top  # one bad id, in the middle of a chunk
    train.tofile(tmp_path / "train.bin")
    (np.arange(500, dtype=np.uint16) % 100).tofile(tmp_path / "val.bin")
    return [f"data.train_bin={tmp_path / 'train.bin'}", f"data.val_bin={tmp_path / 'val.bin'}"]


def test_prepare_data_refuses_ids_beyond_the_vocabulary(tmp_path):
    args = _files(tmp_path, 4096)
    proc = usp_cli("prepare-data", "data=token_files", "data.vocab_size=4096", *args, cwd=tmp_path)
    out = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"data.train_bin='{tmp_path / 'train.bin'}' holds token id 4096" in out
    assert "data.vocab_size=4096" in out and "data.vocab_size=4097 or more" in out
    ok = usp_cli("prepare-data", "data=token_files", "data.vocab_size=4097", *args, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr


def test_train_refuses_them_before_launch(tmp_path):
    proc = usp_cli("train", "data=token_files", "data.vocab_size=50", *_files(tmp_path, 60),
                   f"train.runs_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert proc.returncode == 2 and "holds token id 99" in proc.stderr  # the largest id of the file


def test_the_max_is_taken_over_every_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, "CHECK_CHUNK", 64)  # 1000 tokens: 16 chunks, the last one partial
    for top, where in ((3000, 999), (3000, 0), (3000, 64)):
        ids = np.full(1000, 7, dtype=np.uint16)  # not all zeros: that reads as uint32 ids
        ids[where] = top
        ids.tofile(tmp_path / "t.bin")
        ids[:10].tofile(tmp_path / "v.bin")
        cfg = DataConfig(source="token_files", train_bin=str(tmp_path / "t.bin"), val_bin=str(tmp_path / "v.bin"),
                         vocab_size=3000)
        with pytest.raises(DataError, match="holds token id 3000"):
            ensure_dataset(cfg)
