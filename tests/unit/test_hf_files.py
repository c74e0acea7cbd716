"""A model.init_from directory's weight files are checked by `usp plan` (usp/plan/hf_files.py): a shard
the index lists but the directory lacks, a file cut short and an overwritten header are refused before
launch, naming the file; files written by the real safetensors library pass."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.helpers import plan_for
from usp.contract.hf_shape import hf_config
from usp.errors import PlanError
from usp.plan.hf_files import INDEX, check_hf_files

TENSORS = {"model.embed_tokens.weight": np.ones((64, 16), np.float32), "model.norm.weight": np.ones(16, np.float32)}


def _sharded(path):
    """Two shards and their index, as save_pretrained writes them."""
    path.mkdir()
    names = {}
    for i, (name, value) in enumerate(TENSORS.items()):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({name: value}, str(path / shard), metadata={"format": "pt"})
        names[name] = shard
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": names}))
    return path


def test_files_written_by_safetensors_pass(tmp_path):
    assert check_hf_files(_sharded(tmp_path / "sharded")) == 2
    (tmp_path / "single").mkdir()
    save_file(TENSORS, str(tmp_path / "single" / "model.safetensors"))
    assert check_hf_files(tmp_path / "single") == 2


@pytest.mark.parametrize("damage,says", [
    ("missing", "lists 1 shard(s) that are not in the directory: model-00002-of-00002.safetensors"),
    ("truncated", "model-00001-of-00002.safetensors holds"),
    ("cut_in_header", "model-00001-of-00002.safetensors can't be read"),
    ("header", "model-00001-of-00002.safetensors can't be read"),
    ("grown", "model-00001-of-00002.safetensors holds"),
    ("misplaced", "whose header does not hold it"),
    ("no_weights", "no model.safetensors or model.safetensors.index.json"),
])
def test_a_damaged_directory_is_refused_naming_the_file(tmp_path, damage, says):
    path = _sharded(tmp_path / "hf")
    first, second = path / "model-00001-of-00002.safetensors", path / "model-00002-of-00002.safetensors"
    data = first.read_bytes()
    if damage == "missing":
        second.unlink()
    elif damage == "truncated":
        first.write_bytes(data[:len(data) // 2])
    elif damage == "cut_in_header":
        first.write_bytes(data[:20])
    elif damage == "header":
        first.write_bytes(data[:8] + b"\0" * 16 + data[24:])  # same size, the JSON header clobbered
    elif damage == "grown":
        first.write_bytes(data + b"\0" * 100)
    elif damage == "misplaced":
        index = json.loads((path / INDEX).read_text())
        index["weight_map"]["model.norm.weight"] = first.name
        (path / INDEX).write_text(json.dumps(index))
    else:
        (path / INDEX).unlink()
    with pytest.raises(PlanError) as err:
        check_hf_files(path)
    assert err.value.key == "model.init_from" and says in str(err.value)


def test_usp_plan_refuses_a_truncated_checkpoint(tmp_path):
    """Through the planner: the same directory plans whole, and is refused cut short (it used to launch
    and fail every rank with a SafetensorError)."""
    base = ["data.tokenizer=bytes", "model.vocab_size=512"]
    ckpt = tmp_path / "hf"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(hf_config(plan_for(*base).config.model, 512, 128, "float32")))
    save_file(TENSORS, str(ckpt / "model.safetensors"))
    assert plan_for(*base, f"model.init_from={ckpt}").config.model.init_from == str(ckpt.resolve())
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(PlanError, match="model.safetensors holds"):
        plan_for(*base, f"model.init_from={ckpt}")
