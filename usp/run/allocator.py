"""glibc's malloc on a CPU rank, where the device memory the plan promises is the process's own.

While the model is built and loaded, every allocation above CPU_MMAP_THRESHOLD (1 MiB) is its own
mmap, handed back to the kernel when freed: glibc's default threshold grows to the largest block
freed so far (up to 32 MiB), after which freed parameter-sized blocks (whole values, gathered FSDP
units, gradients) stay in the heap, measured 1.6-1.9x the plan per rank (docs/benchmarks.md,
"Building the model"). Once the trainer is ready the rank switches to the training threshold
(`train_threshold`). A rank that gathers parameters every step (FSDP2, experts) or pipelines
(usp.contract.decide.cpu_memory_first) takes just below the smallest weight matrix above 1 MiB, so
that every parameter-sized block is still mapped and unmapped, and hands the holes a micro batch left
in its heap back after it (`release_free_pages`); any other (DDP, ZeRO-1, TP, one process) takes
glibc's 32 MiB ceiling, with twice it as its trim threshold (glibc's own
pair): its parameters and buckets stay allocated, and its activations are reused from the heap step
after step instead of being faulted in again, which made a small model's CPU step ~1.5x slower
(issue 42; docs/benchmarks.md, "The allocator while training"); the plan counts the heap top that
keeps (usp.perf.memory.heap_top_kept). A MALLOC_MMAP_THRESHOLD_ (or MALLOC_TRIM_THRESHOLD_) of the
user's own is left alone, for the whole run. The memory probe's measured step runs under the build
thresholds again (`build_threshold`). No torch here."""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os

CPU_MMAP_THRESHOLD = 2 ** 20  # while building and loading
MAX_MMAP_THRESHOLD = 32 * 2 ** 20  # glibc's own ceiling for its threshold (64-bit)
M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
DEFAULT_TRIM_THRESHOLD = 128 * 1024  # glibc's own
M_MMAP_THRESHOLD = -3
GLIBC_ENV = "MALLOC_MMAP_THRESHOLD_"  # read by glibc when a process starts
TRIM_ENV = "MALLOC_TRIM_THRESHOLD_"
TRAIN_ENV = "USP_TRAIN_MMAP_THRESHOLD"  # set by usp's launchers: the threshold a rank takes once built
_released_each_micro_batch = False  # set by enter_training: a rank below glibc's ceiling (memory first)


def train_threshold(weight_bytes) -> int:
    """The training threshold for a rank whose weight matrices (as this rank holds or gathers them,
    in bytes) are `weight_bytes`: the smallest one above CPU_MMAP_THRESHOLD (mmap starts at the
    threshold itself), else glibc's ceiling: a model whose matrices are all below 1 MiB has no
    parameter-sized block the 1 MiB threshold ever mapped."""
    above = [int(b) for b in weight_bytes if int(b) > CPU_MMAP_THRESHOLD]
    return min([*above, MAX_MMAP_THRESHOLD])


def cpu_allocator_env(user_env, weight_bytes=()) -> dict[str, str]:
    """The allocator settings for a CPU rank's environment, given the environment it inherits (the
    launcher's, with cluster.env) and the rank's weight matrices: none where the user set glibc's
    threshold."""
    if GLIBC_ENV in user_env:
        return {}
    return {GLIBC_ENV: str(CPU_MMAP_THRESHOLD), TRAIN_ENV: str(train_threshold(weight_bytes))}


def _glibc(name: str, *args: int) -> bool:
    """Call glibc's `name` (mallopt, malloc_trim); False without glibc (macOS, musl: their allocator's
    defaults) or when it refuses."""
    try:
        return bool(getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)(*args))
    except (OSError, AttributeError):
        return False


def _mallopt(param: int, value: int) -> bool:
    return _glibc("mallopt", param, value)


def paired_trim(threshold: int) -> int:
    """The trim threshold glibc pairs with an mmap threshold when it raises its own (malloc.c)."""
    return 2 * threshold


def set_mmap_threshold(value: str | int | None) -> bool:
    """This process's glibc mmap threshold (a process reads MALLOC_MMAP_THRESHOLD_ only when it starts);
    False without glibc or a value."""
    if value is None or not str(value).isdigit():
        return False
    return _mallopt(M_MMAP_THRESHOLD, int(value))


def enter_training() -> bool:
    """A rank whose model is built and loaded: the training threshold, where a launcher of usp's set one,
    and at glibc's ceiling twice it as the trim threshold (`_pairs_trim`), the pair glibc sets itself
    when it raises its own threshold (malloc.c, free of a mapped chunk). A threshold set by mallopt
    leaves the trim threshold at 128 KiB, so the heap's top was handed back and faulted in again every
    step: about 8 % more CPU on a small model's DDP step (docs/benchmarks.md, "The allocator while training")."""
    global _released_each_micro_batch
    value = os.environ.get(TRAIN_ENV)
    if not set_mmap_threshold(value):
        return False
    if _pairs_trim(value):
        _mallopt(M_TRIM_THRESHOLD, paired_trim(int(str(value))))
    _released_each_micro_batch = int(str(value)) < MAX_MMAP_THRESHOLD
    return True


def release_free_pages() -> None:
    """After a micro batch, on a memory-first rank (its training threshold below glibc's ceiling: it gathers
    parameters; a pipeline's micro batches run inside its schedule, out of reach): hand the whole free pages
    inside the heap back (`malloc_trim(0)`).
    A micro batch's small activations (below the threshold, from the heap) are freed around small
    objects still alive, and the holes they leave grew the heap micro batch after micro batch: on
    tp 2 x dp_shard 2, free chunks of 0.12-0.13 GiB inside the heap at the peak (glibc's mallinfo2),
    peak / plan 1.067-1.072; with this 1.003-1.007, each step's time unchanged (docs/benchmarks.md,
    "Heap holes"). Such a rank already maps and unmaps every parameter-sized block each step (memory
    before speed); any other keeps its heap for speed and is left alone."""
    if _released_each_micro_batch:
        _glibc("malloc_trim", 0)


def _pairs_trim(value) -> bool:
    """Does the rank raise its trim threshold with its training threshold? Only at glibc's ceiling (a
    speed-first rank, where it was measured: docs/benchmarks.md), and not over a user's own. FSDP
    ranks keep glibc's 128 KiB: their 4 MiB pair measured 1.006-1.019 of the plan alone, but was never run
    through CI (its first run's 1.13-1.73 was an inherited 32 MiB threshold: usp.launch.local)."""
    return TRIM_ENV not in os.environ and int(str(value)) >= MAX_MMAP_THRESHOLD


@contextlib.contextmanager
def build_threshold():
    """The build threshold for a while: the memory probe's measured step, whose tracker's many small
    Python objects would otherwise land in the freed activations the training threshold keeps in the
    heap, splitting them so that the step's next activations grow the heap (+0.1 GiB per rank measured
    on tp2 x dp_shard2: docs/benchmarks.md, "The plan's figure, gross"). The heap's free top that the
    training trim threshold kept is handed back first: malloc serves a block from it before it maps
    one, whatever the threshold. Nothing where no launcher of usp's set a training threshold."""
    if TRAIN_ENV not in os.environ or not set_mmap_threshold(os.environ.get(GLIBC_ENV)):
        yield
        return
    if _pairs_trim(os.environ[TRAIN_ENV]):
        _mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
        _glibc("malloc_trim", 0)  # the heap's free top (and whole free pages inside it) handed back
    try:
        yield
    finally:
        enter_training()
