"""Top ops from <run_dir>/profile/summary_rank_<R>.txt (the per-step breakdown comes from the
trace: trace.py), read leniently: the file may be torch.profiler's key_averages() table (columns
under a dashed rule, times like "1.234ms") or plain "name: 12.3 ms" lines. Nothing parsed -> the
report shows the text."""
from __future__ import annotations

import re
from pathlib import Path

_TIME = re.compile(r"^([0-9.]+)\s*(us|ms|s)$")
_LINE = re.compile(r"^\s*([A-Za-z_][^:=]*?)\s*[:=]?\s+([0-9.]+)\s*(us|ms|s)\b")
_UNIT_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _ms(text: str) -> float | None:
    match = _TIME.match(text.strip())
    return float(match.group(1)) * _UNIT_MS[match.group(2)] if match else None


def parse_profile(text: str, top: int = 12) -> list[tuple[str, float]]:
    """[(name, ms)], largest first."""
    rows = _parse_table(text) or _parse_lines(text)
    return sorted(rows, key=lambda r: -r[1])[:top]


def _parse_table(text: str) -> list[tuple[str, float]]:
    lines = text.splitlines()
    for i, line in enumerate(lines[:-1]):
        nxt = lines[i + 1]
        if not re.fullmatch(r"[-\s]+", line.strip() or "x") or "Name" not in nxt:
            continue
        spans = [m.span() for m in re.finditer(r"-+", line)]
        header = [nxt[a:b].strip() for a, b in spans]
        # device time when the table has it, else CPU time
        column = next((c for c in ("Self CUDA", "Self Device", "Self XPU", "Self CPU") if c in header), None)
        if column is None:
            return []
        col, rows = header.index(column), []
        for row in lines[i + 3:]:
            if re.fullmatch(r"[-\s]*", row):
                break
            cells = [row[a:b].strip() for a, b in spans]
            value = _ms(cells[col]) if len(cells) > col else None
            if value is not None and cells[0]:
                rows.append((cells[0], value))
        return rows
    return []


def _parse_lines(text: str) -> list[tuple[str, float]]:
    out = []
    for line in text.splitlines():
        match = _LINE.match(line)
        if match:
            out.append((match.group(1).strip(), float(match.group(2)) * _UNIT_MS[match.group(3)]))
    return out


def read_profile(path: Path) -> tuple[list[tuple[str, float]], str]:
    text = path.read_text(errors="replace")
    return parse_profile(text), text
