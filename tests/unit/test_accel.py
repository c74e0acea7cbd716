"""What a GPU run would get from the torch-free layers, checked on CPU: the backend per device, the
plan's flash-attention checks, the workers' environment (CUDA allocator, cuBLAS workspace, torchrun's
store) and the note about visible GPUs (the engine's choices: tests/engine/test_accel.py)."""
from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import plan_for
from usp.config.compose import compose_config
from usp.launch.local import weight_matrix_bytes, worker_env
from usp.plan.plan import build_plan, engine_support_errors
from usp.run.allocator import train_threshold


def plan_of(*overrides: str, obj: bool = False):
    """The plan of a config; obj=False: as a rank reads it back from plan.yaml's values."""
    from usp.contract.plan_file import plan_from_dict

    cfg, choices = compose_config(None, list(overrides))
    plan = build_plan(cfg, choices, training=False)
    return plan if obj else plan_from_dict(plan.to_dict())


def test_flash_attn_plan_errors_name_the_key():
    cpu = engine_support_errors(plan_of("model.attention=flash_attn", obj=True))
    assert [e.key for e in cpu] == ["model.attention"] and "model.attention=sdpa" in str(cpu[0].fix)
    fp32 = engine_support_errors(plan_of("cluster=local_gpu", "model.attention=flash_attn", "train.dtype=fp32",
                                         obj=True))
    assert [e.key for e in fp32] == ["train.dtype"]
    assert engine_support_errors(plan_of("cluster=local_gpu", "model.attention=flash_attn", obj=True)) == []


def test_backend_follows_the_device():
    assert plan_of("cluster=local_gpu").backend == "nccl"
    assert plan_of("cluster=mi300x", "cluster.nodes=1").device == "cuda"  # ROCm: device type cuda, RCCL as nccl
    assert plan_of("cluster=mi300x", "cluster.nodes=1").backend == "nccl"
    xpu = plan_of("cluster=supermuc_ng_p2")
    assert (xpu.device, xpu.backend) == ("xpu", "xccl")
    assert plan_of().backend == "gloo"


def _env_plan(device: str, env: dict | None = None, deterministic: bool | None = None, max_restarts: int = 0,
              dp_kind: str = "fsdp"):
    """The parts of a RunPlan the launcher's environment reads (the decision as the planner makes it)."""
    from usp.contract.config_schema import UspConfig
    from usp.contract.decide import uses_deterministic

    config = UspConfig()
    config.cluster.env, config.train.deterministic, config.train.max_restarts = dict(env or {}), deterministic, \
        max_restarts
    return SimpleNamespace(device=device, threads_per_proc=1, run_dir="/nonexistent/run", nodes=1, config=config,
                           model=SimpleNamespace(vocab_size=4096), degrees={"tp": 1}, fault_tolerance=None,
                           decisions=SimpleNamespace(deterministic=uses_deterministic(deterministic, device),
                                                     hang=None, bf16=False, dp_kind=dp_kind))


def test_ranks_share_the_agents_store_with_or_without_restarts(monkeypatch):
    """Rank 0 binds no port of its own, restarts or not (nothing another launch could take first,
    tests/e2e/test_port_taken.py; each attempt's keys get a prefix instead: parallel/mesh.py)."""
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in worker_env(_env_plan("cpu"))
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in worker_env(_env_plan("cpu", max_restarts=2))


def test_worker_env_sets_expandable_segments_on_cuda_only(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert worker_env(_env_plan("cuda"))["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in worker_env(_env_plan("cpu"))
    # the user's setting wins: from cluster.env, or from the environment
    assert worker_env(_env_plan("cuda", {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}))[
        "PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    assert worker_env(_env_plan("cuda"))["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"


def test_cpu_ranks_build_under_one_malloc_threshold_and_train_under_another(monkeypatch):
    """A CPU rank's memory is the process's: glibc's mmap threshold is fixed at 1 MiB while it builds, so
    that freed large tensors go back to the kernel (docs/benchmarks.md, "Building the model"), and 32 MiB
    once it trains, so that a step's buffers are reused instead of mapped again (issue 42). A threshold
    of the user's wins, for the whole run: no switch then."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    plan = _env_plan("cpu")
    env = worker_env(plan)
    assert (env["MALLOC_MMAP_THRESHOLD_"], env["USP_TRAIN_MMAP_THRESHOLD"]) == \
        (str(2 ** 20), str(train_threshold(weight_matrix_bytes(plan))))
    assert "MALLOC_MMAP_THRESHOLD_" not in worker_env(_env_plan("cuda"))
    own = worker_env(_env_plan("cpu", {"MALLOC_MMAP_THRESHOLD_": "33554432"}))
    assert own["MALLOC_MMAP_THRESHOLD_"] == "33554432" and "USP_TRAIN_MMAP_THRESHOLD" not in own
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    env = worker_env(_env_plan("cpu"))
    assert env["MALLOC_MMAP_THRESHOLD_"] == "131072" and "USP_TRAIN_MMAP_THRESHOLD" not in env


@pytest.mark.parametrize(("overrides", "memory_first"), [
    ((), False), (("parallelism.dp_replicate=2",), False), (("parallelism.dp_replicate=2", "parallelism.zero1=true"),
                                                           False),
    (("parallelism.tp=2",), False), (("parallelism.pp=2",), True), (("parallelism.dp_shard=2",), True),
    (("parallelism.tp=2", "parallelism.dp_replicate=2"), True),  # FSDP2 replication of the DTensor model
    (("model=moe_tiny", "parallelism.dp_shard=2", "parallelism.ep=2"), True)])
def test_only_memory_first_ranks_keep_their_blocks_mapped_while_training(overrides, memory_first):
    """FSDP2 (and the experts' FSDP2 units) allocate and free parameter-sized blocks every step, and a pipeline
    frees its micro batches' activations out of order (its heap kept their holes: docs/benchmarks.md "Heap
    holes"): the training threshold stays below the smallest weight matrix. DDP, ZeRO-1, TP and one process
    keep parameters and gradient buckets all run long: glibc's 32 MiB ceiling, so that activations and logits
    are reused from the heap (issue 42: usp's DDP step took ~15 % more CPU than a hand-written loop's)."""
    from usp.launch.local import cpu_memory_first, plan_accelerator_env

    world = 4 if len(overrides) == 2 and "parallelism.tp=2" in overrides else 2 if overrides else 1
    plan = plan_for(f"cluster.procs_per_node={world}", "model.dim=1024", *overrides, training=False)
    assert cpu_memory_first(plan) is memory_first
    expected = train_threshold(weight_matrix_bytes(plan)) if memory_first else 32 * 2 ** 20
    assert (expected < 32 * 2 ** 20) is memory_first  # dim 1024: 2-4 MiB matrices, also split over tp
    assert plan_accelerator_env(plan, {})["USP_TRAIN_MMAP_THRESHOLD"] == str(expected)


def test_the_training_threshold_keeps_every_parameter_sized_block_mapped():
    """At the smallest weight matrix above 1 MiB (glibc maps a block of the threshold's size or more),
    else glibc's 32 MiB ceiling; the matrices as a rank holds them (split over tp)."""
    mib = 2 ** 20
    assert train_threshold([256 * 1024, mib, 3 * mib, 2 * mib]) == 2 * mib
    assert train_threshold([256 * 1024, mib]) == 32 * mib  # none above 1 MiB: activations reused from the heap
    assert train_threshold([64 * mib]) == 32 * mib
    tiny = weight_matrix_bytes(plan_for(training=False))  # dim 128, vocab 4096: the embedding is 2 MiB in fp32
    assert sorted(tiny) == [128 * 128 * 4, 128 * 128 * 4, 128 * 384 * 4, 4096 * 128 * 4]
    split = weight_matrix_bytes(plan_for("cluster.procs_per_node=2", "parallelism.tp=2", training=False))
    assert sorted(split) == [b // 2 for b in sorted(tiny)]


def test_the_training_threshold_is_set_through_glibc(monkeypatch):
    """enter_training() calls glibc's mallopt (this machine's libc is glibc: it accepts the value) only
    where a launcher of usp's asked for it."""
    from usp.run import allocator

    monkeypatch.delenv(allocator.TRAIN_ENV, raising=False)
    assert allocator.enter_training() is False
    monkeypatch.setenv(allocator.TRAIN_ENV, str(allocator.MAX_MMAP_THRESHOLD))
    assert allocator.enter_training() is True
    assert allocator.set_mmap_threshold("not a number") is False


def _rss_anon_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("RssAnon:"))) * 1024


def _heap_holes(libc, count: int, nbytes: int) -> list[int]:
    """`count` freed blocks of `nbytes` inside the heap, each kept from its neighbours by a small block still
    alive (as a micro batch's activations are by the small objects around them); returns the small blocks."""
    pins, holes = [], []
    for _ in range(count):
        block = libc.malloc(nbytes)
        ctypes.memset(block, 1, nbytes)  # resident, as a tensor's values are
        holes.append(block)
        pins.append(libc.malloc(64))
    for block in holes:
        libc.free(block)
    return pins


@pytest.mark.parametrize("gathers", [True, False])
def test_a_rank_that_gathers_parameters_hands_its_heap_holes_back(monkeypatch, gathers):
    """release_free_pages() (after each micro batch) hands the whole free pages inside the heap back on a rank
    whose training threshold is below glibc's ceiling (it gathers parameters): freed blocks kept apart by live
    ones stay resident otherwise (tp2 x dp_shard2 peaked 1.07x its plan so, docs/benchmarks.md "Heap holes").
    A rank at the ceiling keeps them, to reuse without page faults."""
    from usp.run import allocator

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    threshold = 2 * allocator.CPU_MMAP_THRESHOLD if gathers else allocator.MAX_MMAP_THRESHOLD
    monkeypatch.delenv(allocator.TRIM_ENV, raising=False)
    monkeypatch.setenv(allocator.TRAIN_ENV, str(threshold))
    assert allocator.enter_training()
    holes = 64 * 256 * 1024  # 16 MiB in blocks of 256 KiB: served from the heap under either threshold
    pins = _heap_holes(libc, 64, 256 * 1024)
    before = _rss_anon_bytes()
    allocator.release_free_pages()
    released = before - _rss_anon_bytes()
    for pin in pins:
        libc.free(pin)
    if gathers:
        assert released >= holes // 2, released
    else:
        assert released < holes // 4, released


class _MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2 (malloc.h, glibc >= 2.33)
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _is_mapped(libc, nbytes: int) -> bool:
    """Whether glibc serves a malloc of `nbytes` with its own mmap (the bytes it holds mapped grow)."""
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(nbytes)
    mapped = libc.mallinfo2().hblkhd > before
    libc.free(block)
    return mapped


def test_the_memory_probe_step_runs_under_the_build_threshold(monkeypatch):
    """allocator.build_threshold() (around the probe's measured step): a block between the build and
    the training thresholds is mapped inside it, served from the heap before and after it; nothing
    changes where no launcher of usp's set a training threshold."""
    from usp.run import allocator

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("no glibc >= 2.33 here")
    libc.mallinfo2.restype, libc.malloc.restype = _MallInfo2, ctypes.c_void_p
    libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
    between = 4 * allocator.CPU_MMAP_THRESHOLD
    monkeypatch.setenv(allocator.GLIBC_ENV, str(allocator.CPU_MMAP_THRESHOLD))
    monkeypatch.setenv(allocator.TRAIN_ENV, str(allocator.MAX_MMAP_THRESHOLD))
    assert allocator.enter_training()
    assert not _is_mapped(libc, between)
    with allocator.build_threshold():
        assert _is_mapped(libc, between)
    assert not _is_mapped(libc, between)
    monkeypatch.delenv(allocator.TRAIN_ENV)
    with allocator.build_threshold():
        assert not _is_mapped(libc, between)


def test_training_keeps_the_heap_top_that_glibc_would_keep(monkeypatch):
    """enter_training() also sets the trim threshold to twice the training threshold, as glibc pairs them
    when it raises its own: a freed block at the heap's top stays (mallinfo2's keepcost) instead of being
    handed back and faulted in again by the next step (128 KiB, glibc's trim threshold once a threshold
    is set by mallopt); a user's MALLOC_TRIM_THRESHOLD_ is left alone."""
    from usp.run import allocator

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("no glibc >= 2.33 here")
    libc.mallinfo2.restype, libc.malloc.restype = _MallInfo2, ctypes.c_void_p
    libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
    monkeypatch.delenv(allocator.TRIM_ENV, raising=False)
    monkeypatch.setenv(allocator.TRAIN_ENV, str(allocator.MAX_MMAP_THRESHOLD))
    block_bytes = 8 * 2 ** 20
    assert allocator._mallopt(allocator.M_TRIM_THRESHOLD, 128 * 1024)  # glibc's default
    block = libc.malloc(block_bytes)
    libc.free(block)
    assert libc.mallinfo2().keepcost < block_bytes  # handed back
    assert allocator.enter_training()
    block = libc.malloc(block_bytes)
    libc.free(block)
    assert libc.mallinfo2().keepcost >= block_bytes  # kept for the next step
    assert allocator._mallopt(allocator.M_TRIM_THRESHOLD, 128 * 1024)
    monkeypatch.setenv(allocator.TRAIN_ENV, str(2 * 2 ** 20))  # a rank that gathers: glibc's trim stays
    assert allocator.enter_training()
    block = libc.malloc(2 ** 20 + 2 ** 19)
    libc.free(block)
    assert libc.mallinfo2().keepcost < 2 ** 20 + 2 ** 19


def test_deterministic_cuda_gets_the_cublas_workspace_it_needs(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert worker_env(_env_plan("cuda", deterministic=True))["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert "CUBLAS_WORKSPACE_CONFIG" not in worker_env(_env_plan("cuda"))
    assert "CUBLAS_WORKSPACE_CONFIG" not in worker_env(_env_plan("cpu", deterministic=True))


def test_a_cpu_run_on_a_machine_with_gpus_says_how_to_use_them(tmp_path, monkeypatch):
    import io

    from rich.console import Console

    from usp.launch import pre_launch as prepare

    gpus = tmp_path / "gpus"
    for bus in ("0000:01:00.0", "0000:02:00.0"):
        (gpus / bus).mkdir(parents=True)
    monkeypatch.setattr(prepare, "NVIDIA_GPUS", gpus)

    def note(*overrides: str) -> str:
        cfg, choices = compose_config(None, [f"train.runs_dir={tmp_path}", *overrides])
        out = io.StringIO()
        prepare.prepare_run(cfg, choices, console=Console(file=out, width=300), prepare_data=False)
        return out.getvalue()

    assert "2 NVIDIA GPU(s) visible here" in note() and "cluster=local_gpu cluster.procs_per_node=2" in note()
    assert "visible here" not in note("cluster=local_gpu")
    monkeypatch.setattr(prepare, "NVIDIA_GPUS", tmp_path / "none")  # no driver: no note
    assert "visible here" not in note()


@pytest.mark.parametrize("dtype,device,bf16", [("auto", "cuda", True), ("auto", "xpu", True), ("auto", "cpu", False),
                                               ("fp32", "cuda", False), ("bf16", "cpu", True)])
def test_uses_bf16(dtype, device, bf16):
    from usp.contract.decide import uses_bf16

    assert uses_bf16(dtype, device) is bf16


@pytest.mark.parametrize("configured,device,on", [(None, "cpu", True), (None, "cuda", False), (None, "xpu", False),
                                                  (True, "cuda", True), (False, "cpu", False)])
def test_deterministic_by_default_on_cpu_only(configured, device, on):
    """Parity tests and exact resume need it on CPU (where it costs nothing measurable); on a GPU
    its deterministic kernels (embedding backward, scatter) cost speed, so only when asked. The plan
    records the decision the ranks and the launcher's environment act on."""
    from usp.contract.decide import uses_deterministic

    assert uses_deterministic(configured, device) is on
    gpu = ["cluster=local_gpu"] if device == "cuda" else []
    if device != "xpu":
        det = [] if configured is None else [f"train.deterministic={str(configured).lower()}"]
        assert plan_of(*gpu, *det).decisions.deterministic is on
