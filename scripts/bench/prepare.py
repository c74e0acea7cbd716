#!/usr/bin/env python
"""Data preparation: throughput of `usp prepare-data` (a pretrained BPE tokenizer, files
tokenized by parallel worker processes into cached shards, then copied into train.bin/val.bin)
against the limit, the `tokenizers` library's own encode_batch_fast on the same text held in
memory, with the same cores; and the prepare's peak RSS for two corpus sizes (it must not grow).

    python scripts/bench/prepare.py [--mb 16] [--files 16] [--rss-mb 8 32] [--json]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

WORDS = ("the of and to in is was that for on with as by at from his her they which this be are an not or "
         "have had but one all were we when there can an your more will if out so up said what about into "
         "than them only other new some could time these two may then first any like now over such our man "
         "also most after made know where much through back years good way well down should because each "
         "just those people how too little state good very make world still own see men work long get here "
         "between both life being under never day same another know while last might us great old year off "
         "come since against go came right used take three").split()


def write_corpus(directory: Path, mb: float, files: int = 8, seed: int = 0) -> Path:
    """About `mb` MB of word text in `files` files (written a line at a time: any size)."""
    import random

    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    per_file = int(mb * 1e6 / files)
    for i in range(files):
        with open(directory / f"part{i:03d}.txt", "w") as f:
            written = 0
            while written < per_file:
                line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 20))).capitalize() + ".\n"
                written += f.write(line)
    return directory


def bench_tokenizer(directory: Path) -> Path:
    """A byte-level BPE (vocab 8192) trained on the first file: the 'pretrained' tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = directory / "tokenizer.json"
    if not path.exists():
        hf = Tokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        hf.train([str(write_corpus(directory / "train_text", 2, files=1) / "part000.txt")], trainer=trainer)
        hf.save(str(path))
    return path


PREPARE = """
import json, resource, sys, time
from usp.contract.config_schema import DataConfig
from usp.data.tokenized import ensure_dataset
cfg = DataConfig(name="bench", source="files", paths=[sys.argv[1]], tokenizer="hf" if sys.argv[3] else "bytes",
                 tokenizer_path=sys.argv[3] or None, cache_dir=sys.argv[2], workers=int(sys.argv[4]))
start = time.perf_counter()
_, meta = ensure_dataset(cfg)
rss = max(resource.getrusage(w).ru_maxrss for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
print(json.dumps({"seconds": time.perf_counter() - start, "peak_rss_mb": rss / 1024,
                  "tokens": meta["n_train_tokens"] + meta["n_val_tokens"], "bytes": meta["n_bytes"]}))
"""


def run_prepare(corpus: Path, cache: Path, workers: int, tokenizer: Path | None = None) -> dict:
    """One cold `ensure_dataset` in a fresh process (so its peak RSS is its own)."""
    env = dict(os.environ, PYTHONPATH=str(_common.REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", PREPARE, str(corpus), str(cache), str(tokenizer or ""),
                          str(workers)], capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def peak_rss_mb(corpus: Path, cache: Path, workers: int = 1, tokenizer: Path | None = None) -> float:
    return run_prepare(corpus, cache, workers, tokenizer)["peak_rss_mb"]


def encode_batch_limit(corpus: Path, tokenizer: Path) -> dict:
    """The `tokenizers` library's own batch encoding of the same text, all in memory (Rust threads)."""
    from tokenizers import Tokenizer

    from usp.data.corpus import file_units, unit_pieces

    hf = Tokenizer.from_file(str(tokenizer))
    texts = [piece for unit in file_units([str(corpus)]) for _, piece in unit_pieces(unit)]  # usp's pieces
    start = time.perf_counter()
    n_tokens = sum(len(e.ids) for e in hf.encode_batch_fast(texts, add_special_tokens=False))
    return {"seconds": time.perf_counter() - start, "tokens": n_tokens,
            "bytes": sum(len(t.encode()) for t in texts)}


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--mb", type=float, default=16, help="corpus size for the throughput comparison")
    p.add_argument("--files", type=int, default=16)
    p.add_argument("--rss-mb", type=float, nargs=2, default=[8, 32], help="two corpus sizes for peak RSS")
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="usp-bench-prepare-") as tmp:
        work = Path(tmp)
        tokenizer = bench_tokenizer(work)
        corpus = write_corpus(work / "corpus", args.mb, args.files)
        limit = encode_batch_limit(corpus, tokenizer)
        usp = run_prepare(corpus, work / "cache", cores, tokenizer)
        rss = {mb: run_prepare(write_corpus(work / f"rss{mb}", mb, 1), work / f"rss_cache{mb}", 1, tokenizer)
               for mb in args.rss_mb}
    result = {
        **_common.machine(), "cores_used": cores, "corpus_mb": usp["bytes"] / 1e6, "files": args.files,
        "usp_prepare_mb_per_s": usp["bytes"] / 1e6 / usp["seconds"],
        "encode_batch_mb_per_s": limit["bytes"] / 1e6 / limit["seconds"],
        "usp_vs_limit": limit["seconds"] / usp["seconds"],
        "same_tokens": usp["tokens"] == limit["tokens"] + args.files,  # usp adds one EOS per document (file)
        "peak_rss_mb": {f"{mb:g} MB corpus (1 file, 1 worker)": round(r["peak_rss_mb"], 1) for mb, r in rss.items()},
    }
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key}: {value:.3g}" if isinstance(value, float) else f"{key}: {value}")


if __name__ == "__main__":
    main()
