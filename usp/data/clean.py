"""`usp prepare-data --clean`: remove the cache entries the current config no longer uses.

Removed: datasets of the same data.name with another fingerprint (an older corpus, tokenizer or
split), temp dirs and files a killed prepare left (.*.tmp-*), shards and trained BPE tokenizers
that no remaining dataset uses. Kept: the current dataset and every dataset of another name."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from usp.data.tokenized import META_FILE, cache_base, dataset_name


def clean_caches(data_cfg: Any, keep: Path) -> list[Path]:
    base = cache_base(data_cfg)
    datasets, shards, tokenizers = base / "datasets", base / "shards", base / "tokenizers"
    removed: list[Path] = []
    prefix = f"{dataset_name(data_cfg)}-"
    for path in sorted(datasets.iterdir()) if datasets.is_dir() else []:
        if path != keep and (path.name.startswith(prefix) or ".tmp-" in path.name or ".junk-" in path.name):
            removed.append(path)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)

    used_shards: set[str] = set()
    used_bpe: set[str] = set()
    for meta_path in datasets.glob(f"*/{META_FILE}") if datasets.is_dir() else []:
        meta = json.loads(meta_path.read_text())
        used_shards.update(meta.get("shards") or [])
        if meta.get("bpe_tokenizer"):
            used_bpe.add(f"bpe-{meta['bpe_tokenizer']}")
    for path in sorted(shards.iterdir()) if shards.is_dir() else []:
        if ".tmp-" in path.name or path.name.split(".")[0] not in used_shards:
            path.unlink(missing_ok=True)
            removed.append(path)
    for path in sorted(tokenizers.iterdir()) if tokenizers.is_dir() else []:
        if ".tmp-" in path.name or path.name not in used_bpe:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
