"""Is each input file of a text source text? Checked before anything is read for training the BPE
or tokenized, so that a Latin-1 file, random bytes or a program in a data directory is named
instead of becoming U+FFFD characters and garbage tokens.

Every text file (and .json / .jsonl record file) of the user's sources (data.paths, a blend's
paths) is read once, a MiB at a time: a NUL byte, or more than MAX_CONTROL_SHARE of control bytes
in its first SAMPLE_BYTES, makes it binary; bytes that don't decode as UTF-8 make it not UTF-8
(the byte offset and line are named). A file whose content passes but whose extension is not one
the text reader knows is read as plain text, with a warning. The built-in corpora are not checked.

data.text_check decides what a failing file does: strict (default) refuses the corpus, naming
every such file; skip leaves them out, one warning each; off checks nothing (the reader then
replaces invalid bytes with U+FFFD)."""
from __future__ import annotations

import codecs
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from usp.data.corpus import RECORD_SUFFIXES, Unit
from usp.data.data_error import DataError

TEXT_CHECKS = ("strict", "skip", "off")
CHECKED_SOURCES = ("text_files", "files", "blend")
CHUNK_BYTES = 1 << 20
SAMPLE_BYTES = 1 << 16
MAX_CONTROL_SHARE = 0.10  # text has a few (form feeds, escapes); binaries have many more
# ASCII control bytes other than tab, line feed, vertical tab, form feed, carriage return, escape
CONTROL_BYTES = bytes([*range(0x00, 0x09), *range(0x0E, 0x1B), *range(0x1C, 0x20), 0x7F])
TEXT_SUFFIXES = frozenset((
    "", ".txt", ".text", ".md", ".markdown", ".rst", ".adoc", ".org", ".tex", ".html", ".htm", ".xml",
    ".csv", ".tsv", ".log", ".srt", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".java",
    ".js", ".ts", ".go", ".rs", ".rb", ".sh", ".sql", ".yaml", ".yml", ".toml", ".ini", ".cfg", ".css",
    *RECORD_SUFFIXES))
FIX = ("data.text_check=skip leaves such files out (a warning names each), data.text_check=off reads them "
       "as text anyway (invalid bytes become U+FFFD), or remove them from {key}")


@dataclass(frozen=True)
class Problem:
    path: str
    what: str


def check_units(data_cfg: Any, units: list[Unit], key: str, warn: Callable[[str], None]) -> list[Unit]:
    """The units to tokenize: all of them, or (data.text_check=skip) those that are text. Raises a
    DataError naming every non-text file under strict; warns about unknown extensions."""
    mode = str(getattr(data_cfg, "text_check", "strict") or "strict")
    if mode not in TEXT_CHECKS:
        raise DataError(f"data.text_check={mode!r} is not one of {', '.join(TEXT_CHECKS)}\n  fix: "
                        "data.text_check=strict (refuse files that aren't UTF-8 text), skip or off")
    if mode == "off" or getattr(data_cfg, "source", None) not in CHECKED_SOURCES:
        return units
    checked = [(unit, file_problem(Path(unit.path))) for unit in units if unit.reader in ("text", "json")]
    problems = [problem for _, problem in checked if problem is not None]
    unknown = sorted(u.path for u, p in checked if p is None and Path(u.path).suffix.lower() not in TEXT_SUFFIXES)
    if unknown:
        warn(f"{key}: {_listed(unknown)}: an extension the text reader doesn't know, read as plain text "
             f"(its content is UTF-8 text); data.text_check=off checks nothing and says nothing")
    if not problems:
        return units
    if mode == "strict":
        lines = "".join(f"\n  {p.path}: {p.what}" for p in problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise DataError(f"{key}: {len(problems)} file(s) are not UTF-8 text:{lines}{more}\n  fix: "
                        + FIX.format(key=key))
    for p in problems:
        warn(f"{key}: left out {p.path}: {p.what} (data.text_check=skip)")
    bad = {p.path for p in problems}
    kept = [u for u in units if u.path not in bad]
    if not kept:
        raise DataError(f"{key}: none of its files is UTF-8 text (data.text_check=skip left out all "
                        f"{len(units)})\n  fix: point {key} at text files")
    return kept


def file_problem(path: Path) -> Problem | None:
    """Why the file isn't UTF-8 text, or None if it is."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, lines = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            binary = _binary(chunk, offset)
            if binary:
                return Problem(str(path), binary)
            pending = len(decoder.getstate()[0])  # the previous chunk's last bytes of a character
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:  # exc.object: the pending bytes, then this chunk
                at = offset - pending + exc.start
                line = lines + exc.object.count(b"\n", pending, max(pending, exc.start)) + 1
                return Problem(str(path), f"not valid UTF-8: byte 0x{exc.object[exc.start]:02x} at offset {at:,} "
                                          f"(line {line:,}); Latin-1 or Windows-1252 text? convert it with "
                                          f"iconv -f latin1 -t utf-8")
            offset, lines = offset + len(chunk), lines + chunk.count(b"\n")
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return Problem(str(path), f"not valid UTF-8: it ends inside a character (offset {offset:,})")
    return None


def _binary(chunk: bytes, offset: int) -> str | None:
    nul = chunk.find(b"\0")
    if nul >= 0:
        return f"binary: a NUL byte at offset {offset + nul:,}" + (_UTF16_HINT if _utf16(chunk) else "")
    if offset == 0:
        sample = chunk[:SAMPLE_BYTES]
        control = len(sample) - len(sample.translate(None, CONTROL_BYTES))
        if control > MAX_CONTROL_SHARE * len(sample):
            return f"binary: {control / len(sample):.0%} of its first {len(sample):,} bytes are control bytes"
    return None


_UTF16_HINT = " (UTF-16 text? convert it with iconv -f utf-16 -t utf-8)"


def _utf16(chunk: bytes) -> bool:
    """A byte-order mark, or NUL in most even or most odd places (ASCII text as UTF-16)."""
    sample = chunk[:SAMPLE_BYTES]
    half = max(1, len(sample) // 2)
    return sample[:2] in (b"\xff\xfe", b"\xfe\xff") or max(sample[0::2].count(0), sample[1::2].count(0)) > 0.8 * half


def _listed(paths: list[str], limit: int = 5) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")

