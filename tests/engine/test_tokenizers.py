"""A vocabulary over 65,536 ids gives uint32 token files that train."""
from __future__ import annotations

import numpy as np
import pytest

from tests.data_builders import WORDS, big_wordlevel_tokenizer, word_corpus
from usp.contract.config_schema import DataConfig
from usp.data.tokenized import ensure_dataset


def test_a_vocab_over_65536_gives_uint32_files_that_train(tmp_path):
    """A 70,002-id tokenizer built here -> uint32 token files -> a short training run on them."""
    from tests.engine.test_training import train_inprocess

    path, words = big_wordlevel_tokenizer(tmp_path / "tok")
    rare = words[-500:]  # ids above 65,535
    for i in range(2):
        (tmp_path / f"doc{i}.txt").write_text(word_corpus(12_000, WORDS + rare, seed=i))
    data = ["data=text_files", f"data.paths=[{tmp_path}/doc*.txt]", "data.tokenizer=hf",
            f"data.tokenizer_path={path}", "data.val_fraction=0.4"]
    cfg = DataConfig(name="text_files", source="text_files", paths=[f"{tmp_path}/doc*.txt"], tokenizer="hf",
                     tokenizer_path=str(path), val_fraction=0.4)
    directory, meta = ensure_dataset(cfg)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_002
    train = np.fromfile(directory / meta["train_bin"], dtype=np.uint32)
    assert len(train) == meta["n_train_tokens"] and train.max() > 65_535 and train.max() < 70_002
    metrics = train_inprocess(tmp_path / "runs", *data, "model.dim=32", "model.n_heads=2", "model.n_kv_heads=2",
                              "model.ffn_dim=64", "train.seq_len=64", "train.global_batch=4", "train.steps=3",
                              "checkpoint.enabled=false", "train.measure_memory=false", "train.eval_batches=1")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[0]["loss"] == pytest.approx(np.log(70_002), rel=0.05)  # a 70,002-way softmax at the start
