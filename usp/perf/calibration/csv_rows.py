"""A CSV of measured runs (or of model shapes) read strictly: UTF-8 text, a header holding the columns
asked for, and every value of its kind. A mistake is one UspError naming the file, the line and the
column, never a KeyError, ValueError or UnicodeDecodeError from deep inside `usp calibrate`."""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from usp.errors import UspError

# column kinds: what a value must be, and how a message says it
KINDS = {
    "count": ("an integer >= 1", lambda v: v.isdigit() and int(v) >= 1),
    "flag": ("0 or 1", lambda v: v in ("0", "1")),
    "bool": ("true or false", lambda v: v.lower() in ("true", "false")),
    "percent": ("a number in [0, 100] (or empty)", lambda v: not v or _number(v, 0, 100)),
    "number": ("a number >= 0 (or empty)", lambda v: not v or _number(v, 0, math.inf)),
    "text": ("any text", lambda v: bool(v)),
    "optional_count": ("an integer >= 1 (or empty)", lambda v: not v or v.isdigit() and int(v) >= 1),
}


def _number(value: str, lo: float, hi: float) -> bool:
    """value is a finite number in [lo, hi]."""
    try:
        x = float(value)
    except ValueError:
        return False
    return math.isfinite(x) and lo <= x <= hi


def read_rows(path: Path, columns: dict[str, str], optional: dict[str, str], key: str,
              example: str) -> list[tuple[int, dict[str, str]]]:
    """[(line, row)] of a CSV whose header has every column of `columns` ({name: kind}, KINDS) and
    maybe those of `optional`; each value stripped and checked. key: the option that named the file
    (its errors' key); example: a file to imitate (the fix)."""
    text = _text(path, key, example)
    reader = csv.reader(io.StringIO(text))
    try:
        header = [h.strip() for h in next(reader, [])]
        missing = [c for c in columns if c not in header]
        if missing:
            raise UspError(f"{path} is not a CSV of this kind: its header lacks the column(s) {', '.join(missing)} "
                           f"(it has: {', '.join(header) or 'nothing'})", key=key, value=str(path),
                           fix=f"a header line {','.join(columns)}[,{','.join(optional)}] (like {example})")
        rows = []
        for values in reader:
            if not any(v.strip() for v in values):
                continue
            line = reader.line_num
            if len(values) != len(header):
                raise UspError(f"{path}:{line}: {len(values)} values, but the header names {len(header)} columns",
                               key=key, value=str(path), fix=f"one value per column on line {line} (like {example})")
            row = {h: v.strip() for h, v in zip(header, values)}
            for name, kind in {**columns, **{c: k for c, k in optional.items() if c in row}}.items():
                says, ok = KINDS[kind]
                if not ok(row[name]):
                    raise UspError(f"{path}:{line}: column {name} is {row[name]!r}, not {says}", key=key,
                                   value=str(path), fix=f"fix line {line} of {path.name} (or drop the row)")
            rows.append((line, row))
    except csv.Error as exc:
        raise UspError(f"{path}:{reader.line_num}: not a readable CSV ({exc})", key=key, value=str(path),
                       fix=f"a comma-separated text file like {example}") from None
    if not rows:
        raise UspError(f"{path} has a header but no rows", key=key, value=str(path),
                       fix=f"one row per measured run (like {example})")
    return rows


def _text(path: Path, key: str, example: str) -> str:
    """The file as text: refused when it is binary (a NUL byte) or not UTF-8, naming the byte."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UspError(f"can't read {path}: {exc.strerror or exc}", key=key, value=str(path),
                       fix="pass an existing, readable file") from None
    nul = raw.find(b"\0")
    if nul >= 0:
        raise UspError(f"{path} is a binary file (a NUL byte at offset {nul}), not a CSV", key=key,
                       value=str(path), fix=f"a comma-separated text file like {example}")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UspError(f"{path} is not UTF-8 text (byte offset {exc.start})", key=key, value=str(path),
                       fix=f"save it as UTF-8 (a comma-separated text file like {example})") from None
