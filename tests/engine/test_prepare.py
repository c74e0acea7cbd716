"""Directories expanded into one document per file or record, HF-datasets records included (the
datasets library imports torch when it is installed, hence here; the rest: tests/unit/test_prepare.py)."""
from __future__ import annotations

import json

import numpy as np

from tests.data_builders import WORDS, word_corpus
from tests.unit.test_prepare import _cfg, _files
from usp.data.tokenized import ensure_dataset


def test_directories_expand_to_one_document_per_file_or_record(tmp_path):
    corpus = tmp_path / "corpus"
    _files(corpus / "sub", 2)
    (corpus / "notes.md").write_text(word_corpus(3000, WORDS, seed=9))
    (corpus / ".hidden.txt").write_text("never read")
    (corpus / "records.jsonl").write_text("".join(json.dumps({"text": word_corpus(900, WORDS, seed=20 + i)}) + "\n"
                                                  for i in range(3)))
    messages: list[str] = []
    directory, meta = ensure_dataset(_cfg(tmp_path, workers=1), progress=messages.append)
    assert (meta["n_files"], meta["n_documents"]) == (4, 6)  # 3 text files + 3 records; the hidden file skipped
    tokens = np.concatenate([np.fromfile(directory / meta[k], dtype=np.uint16) for k in ("train_bin", "val_bin")])
    text = bytes(tokens.astype(np.uint8)).decode()
    assert "never read" not in text and text.count("\n\n") == 6  # every document ends with the bytes EOS
    assert meta["blend"][0]["val_split"] == "documents" and text.endswith("\n\n")
