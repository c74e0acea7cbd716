"""Sources read with HF datasets (jsonl, parquet, arrow) and blended by weight: the requested token
shares, the same samples under any layout, and clear errors that leave nothing half-written. Corpora
are built here; nothing is downloaded (the datasets library imports torch; resuming after a kill:
tests/e2e/test_blend.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from usp.config.compose import compose_config
from usp.data.blend import BlendedSampler, block_counts, make_sampler
from usp.data.data_error import DataError
from usp.data.sampler import TokenFile
from usp.data.tokenized import ensure_dataset

pytest.importorskip("datasets")  # the optional extra `usp[hf]` (installed by `make test`)

JSONL_ALPHABET, PARQUET_ALPHABET = "abcdefgh", "STUVWXYZ"


def _words(alphabet: str, n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join("".join(rng.choice(list(alphabet), size=rng.integers(2, 7))) for _ in range(n))


def _text(ids: np.ndarray) -> str:
    return bytes(ids.astype(np.uint8)).decode()  # the bytes tokenizer: id = byte


def write_sources(directory: Path) -> tuple[Path, Path]:
    """A jsonl of records {"text": ...} and a parquet with a "content" column, each in its own
    alphabet (so a window's bytes say which source it came from)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    jsonl = directory / "web.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "text": _words(JSONL_ALPHABET, 400, i)}) + "\n" for i in range(40)))
    parquet = directory / "code.parquet"
    pq.write_table(pa.table({"content": [_words(PARQUET_ALPHABET, 400, 100 + i) for i in range(30)]}), parquet)
    return jsonl, parquet


def blend_recipe(directory: Path, jsonl: Path, parquet: Path, **data: object) -> Path:
    """A recipe: the blend, the bytes tokenizer (fast), a very small model."""
    import yaml

    recipe = {
        "defaults": ["config", "_self_"],
        "data": {"name": "mix", "source": "blend", "tokenizer": "bytes", "val_fraction": 0.1,
                 "workers": 1,  # in this process: `datasets` is imported once, not in every worker
                 "blend": [{"name": "web", "paths": [str(jsonl)], "weight": 0.7},
                           {"name": "code", "paths": [str(parquet)], "weight": 0.3, "text_field": "content"}],
                 **data},
        "model": {"dim": 32, "n_heads": 2, "n_kv_heads": 2, "ffn_dim": 64},
        "train": {"seq_len": 64, "global_batch": 8, "steps": 8},
    }
    path = directory / "mix.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mix")
    jsonl, parquet = write_sources(directory)
    recipe = blend_recipe(directory, jsonl, parquet, cache_dir=str(directory / "cache"))
    cfg, _ = compose_config(str(recipe), [])
    path, meta = ensure_dataset(cfg.data)
    return directory, recipe, cfg, path, meta


def test_blend_prepares_each_source_by_documents(mix):
    _, _, _, path, meta = mix
    web, code = meta["blend"]
    assert (web["name"], web["n_documents"], code["name"], code["n_documents"]) == ("web", 40, "code", 30)
    assert web["val_split"] == code["val_split"] == "documents"
    train = TokenFile(path / meta["train_bin"], meta["dtype"], meta["n_train_tokens"])
    web_text = _text(train.window(0, web["n_train_tokens"]))
    code_text = _text(train.window(code["train_offset"], code["n_train_tokens"]))
    assert set(web_text) == set(JSONL_ALPHABET + " \n") and set(code_text) == set(PARQUET_ALPHABET + " \n")


def test_blend_gives_the_requested_token_shares(mix):
    _, _, _, path, meta = mix
    train = TokenFile(path / meta["train_bin"], meta["dtype"], meta["n_train_tokens"])
    sampler = make_sampler(meta, seq_len=64, global_batch=16, micro_batch=16, dp_rank=0, dp_size=1, seed=3)
    assert isinstance(sampler, BlendedSampler)
    starts = np.concatenate([np.concatenate(sampler.next()) for _ in range(250)])  # 4,000 windows
    sources = np.searchsorted(sampler.offsets, starts, side="right") - 1  # the source each window starts in
    tokens = np.bincount(sources, minlength=2) * 65  # every window is seq_len + 1 tokens
    assert abs(tokens[0] / tokens.sum() - 0.7) < 0.02 and abs(tokens[1] / tokens.sum() - 0.3) < 0.02
    for start, source in zip(starts[:200], sources[:200]):  # each window lies inside its source
        text = set(_text(train.window(int(start), 65)))
        assert text <= set((JSONL_ALPHABET if source == 0 else PARQUET_ALPHABET) + " \n")
    assert list(block_counts([0.7, 0.3])) == [2867, 1229]  # largest remainders: the block's shares add up


def test_blend_is_layout_independent_and_resumes(mix):
    meta = mix[4]

    def step_union(step: int, dp: int, sampler_kw: dict) -> np.ndarray:  # micro-batch steps in order
        ranks = [make_sampler(meta, dp_rank=r, dp_size=dp, **sampler_kw).micro_batches(step) for r in range(dp)]
        return np.concatenate([micro[j] for j in range(len(ranks[0])) for micro in ranks])

    kw = dict(seq_len=64, global_batch=16, seed=5)
    for step in (0, 7, 300):  # 300: past the first block of 4,096 samples
        single = step_union(step, 1, {**kw, "micro_batch": 16})
        assert np.array_equal(step_union(step, 2, {**kw, "micro_batch": 4}), single)
        assert np.array_equal(step_union(step, 4, {**kw, "micro_batch": 2}), single)
    run = make_sampler(meta, micro_batch=8, dp_rank=0, dp_size=1, **kw)
    for _ in range(40):
        run.next()
    state = json.loads(json.dumps(run.state_dict()))  # what a checkpoint keeps
    expected = [np.concatenate(run.next()) for _ in range(5)]
    halves = [make_sampler(meta, micro_batch=4, dp_rank=r, dp_size=2, **{**kw, "seed": 0}) for r in range(2)]
    for half in halves:
        half.load_state_dict(state)  # another layout, another configured seed: the checkpoint's order wins
    for want in expected:
        micro_steps = zip(*[h.next() for h in halves])  # each: the ranks' micro batches of one micro-batch step
        assert np.array_equal(np.concatenate([m for step in micro_steps for m in step]), want)
    reweighted = {**meta, "blend": [{**p, "weight": 0.5} for p in meta["blend"]]}
    with pytest.raises(ValueError, match="blend"):
        make_sampler(reweighted, micro_batch=8, dp_rank=0, dp_size=1, **kw).load_state_dict(state)


@pytest.mark.parametrize("case,words", [
    ("missing_field", r"data\.text_field='body' is not a column of .*web\.jsonl.*\['id', 'text'\]"),
    ("bad_parquet", r"data\.paths: .*broken\.parquet can't be read as parquet"),
    ("bad_weight", r"data\.blend\[1\]\.weight=0\.0 must be > 0"),
    ("no_files", r"data\.blend\[0\]\.paths: no files match"),
])
def test_bad_sources_name_the_key_and_leave_nothing(tmp_path, case, words):
    jsonl, parquet = write_sources(tmp_path / "src")
    data: dict = {"cache_dir": str(tmp_path / "cache")}
    recipe = blend_recipe(tmp_path, jsonl, parquet, **data)
    overrides = {
        "missing_field": ["data.text_field=body"],
        "bad_parquet": [f"data.blend.1.paths=[{tmp_path / 'broken.parquet'}]"],
        "bad_weight": ["data.blend.1.weight=0"],
        "no_files": [f"data.blend.0.paths=[{tmp_path / 'nothing'}/*.jsonl]"],
    }[case]
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really a parquet file PAR1")
    cfg, _ = compose_config(str(recipe), overrides)
    with pytest.raises(DataError, match=words):
        ensure_dataset(cfg.data)
    datasets = tmp_path / "cache" / "datasets"
    assert not datasets.exists() or list(datasets.iterdir()) == []  # no temp dir, no half dataset
    shards = tmp_path / "cache" / "shards"
    assert not shards.exists() or not [p for p in shards.iterdir() if ".tmp-" in p.name]


def test_the_continued_pretraining_recipe_plans_and_prepares(tmp_path):
    """recipes/continue_pretraining_blend.yaml with its three paths pointed at files built here:
    it plans (the model's 128,256 rows hold the tokenizer's ids) and its data prepares as a blend."""
    from tests.data_builders import hf_bpe_tokenizer
    from usp.plan.plan import checked_plan

    jsonl, parquet = write_sources(tmp_path / "src")
    hf_bpe_tokenizer(tmp_path / "model", [_words(JSONL_ALPHABET + PARQUET_ALPHABET, 2000, 1)])
    cfg, choices = compose_config("continue_pretraining_blend", [
        f"data.tokenizer_path={tmp_path / 'model'}", f"data.blend.0.paths=[{jsonl}]",
        f"data.blend.1.paths=[{parquet}]", "data.val_fraction=0.1", "data.workers=1",
        f"data.cache_dir={tmp_path / 'cache'}", f"train.runs_dir={tmp_path / 'runs'}"])
    plan = checked_plan(cfg, choices)
    assert plan.model.vocab_size == 128256 and plan.device == "cuda"
    directory, meta = ensure_dataset(cfg.data)
    assert [p["name"] for p in meta["blend"]] == ["web", "code"] and meta["add_bos"] and meta["tokenizer"] == "hf"
    assert str(directory) == plan.dataset_dir
