"""Preparing a corpus keeps its memory bounded: the peak RSS of `usp prepare-data` (its own process)
does not grow with the corpus."""
from __future__ import annotations

import sys

from tests.helpers import REPO


def test_peak_memory_does_not_grow_with_the_corpus(tmp_path):
    """Peak RSS of a prepare of 4 MB and of 16 MB of text (one file each: streamed in pieces)."""
    sys.path.insert(0, str(REPO / "scripts" / "bench"))
    from prepare import peak_rss_mb, write_corpus

    rss = {}
    for mb in (4, 16):
        corpus = write_corpus(tmp_path / f"c{mb}", mb, files=1)
        rss[mb] = peak_rss_mb(corpus, tmp_path / f"cache{mb}", workers=1)
    # Holding the corpus (the old prepare: ~47 bytes per character) would add ~560 MB.
    assert rss[16] < rss[4] + 40, rss
