"""Reports of finished (or running) runs and sweeps: PNG plots + report.md, read from run
directories only. No torch; matplotlib is imported when a plot is drawn (Agg backend).

    write_report(["runs/a", "runs/b"])  -> runs/a/report/{report.md, loss.png, ...}
    write_report(["runs/my_sweep"])     -> runs/my_sweep/report/ (+ results table, heatmap, scaling)
"""
from __future__ import annotations


def write_report(paths, out=None, force=False):
    from usp.report.report import write_report as _write

    return _write(list(paths), out, force)
