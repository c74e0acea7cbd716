"""Python's cyclic garbage collector while a process imports torch (no torch import here).

Importing torch with DTensor and DCP, as every rank does, makes about 400,000 objects the collector
tracks, and its automatic full collections scan them all again and again. Measured on the 2-core
test machine (docs/engine.md): `import usp.engine.worker` took 1.81 CPU-s with the collector on and
1.37 with it off; a tiny two-rank `usp train` took 10.0 CPU-s (6.8 s) before this module and 6.8
CPU-s (4.8 s) after.

So a process that trains imports with the collector off (`pause`), then moves everything alive
into the permanent generation that no collection scans again (`freeze_imports`: gc.freeze, the use
CPython documents for a process that forks after its imports) and turns the collector back on.
What the run allocates after that is collected as before."""
from __future__ import annotations

import gc
import sys
from contextlib import contextmanager


def pause() -> None:
    """Before the process's first torch import: usp/engine/__init__.py, when Python was started as
    `python -m usp.engine.<entry>`. The entry's `__main__` block calls freeze_imports()."""
    gc.disable()


def freeze_imports() -> None:
    """After the imports: what they made is frozen out of the collector's sight, which is on again."""
    gc.freeze()
    gc.enable()


@contextmanager
def importing_torch():
    """For a process that imports the engine halfway through its life (one rank trains in `usp
    train`'s own process). Only at the first torch import: what is alive then, garbage not yet
    collected included, is frozen for good, so it is collected first (a few ms before torch)."""
    if "torch" in sys.modules:
        yield
        return
    gc.collect()
    pause()
    try:
        yield
    finally:
        freeze_imports()
