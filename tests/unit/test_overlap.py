"""usp/report/overlap.py: communication time and the part of it hidden behind compute, on small
synthetic Chrome traces with exact answers (a real 2-rank DDP profile: tests/e2e/test_overlap.py).

What the real CPU traces show (see overlap.py's docstring): DDP's bucket all-reduces run on gloo
worker threads while the main thread goes on with the backward. With the default 25 MB buckets the
tiny model (3.8 MB of gradients) has one bucket, launched by the last gradient, so almost nothing
overlaps; with 1 MB buckets the first buckets' all-reduces run under the backward of the earlier
layers, so the real run uses ddp_bucket_mb=1 and asserts overlap > 0. (FSDP2 on gloo waits for
each all-gather / reduce-scatter on the main thread: overlap 0; scripts/bench/overlap.py shows it.)"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from usp.report.overlap import intersect, merge, overlap_markdown, step_overlaps, totals

MAIN, WORKER, WORKER2 = 10, 11, 12  # thread ids of one rank (pid 1)


def ev(name: str, start_ms: float, dur_ms: float, tid: int = MAIN, cat: str = "cpu_op", pid=1, **args) -> dict:
    """A complete ("X") event; times in ms here, microseconds in the trace like the profiler's."""
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": start_ms * 1e3, "dur": dur_ms * 1e3,
            "args": args}


def step(n: int, start_ms: float = 0, dur_ms: float = 100) -> dict:
    return ev(f"usp_step_{n}", start_ms, dur_ms, cat="user_annotation")


def only(events: list[dict]):
    (result,) = step_overlaps(events, rank=0)
    return result


def test_interval_helpers():
    assert merge([(5, 7), (0, 2), (1, 3), (7, 8), (9, 9)]) == [(0, 3), (5, 8)]
    assert intersect([(0, 3), (5, 8)], [(2, 6), (7, 10)]) == [(2, 3), (5, 6), (7, 8)]


def test_gloo_collective_half_covered_by_main_thread_compute():
    o = only([step(3), ev("aten::mm", 0, 40), ev("gloo:all_reduce", 20, 40, WORKER, "user_annotation")])
    assert (o.step, o.comm_ms, o.overlapped_ms, o.fraction, o.source) == (3, 40.0, 20.0, 0.5, "CPU threads")


def test_concurrent_collectives_and_nested_ops_count_once():
    o = only([step(3),
              ev("c10d::allreduce_", 19, 2),  # the launch on the main thread: not the collective's time
              ev("gloo:all_reduce", 20, 40, WORKER, "user_annotation"),
              ev("gloo:all_gather", 40, 40, WORKER2, "user_annotation"),  # union with the first: 20..80
              ev("aten::addmm", 50, 20), ev("aten::mul", 55, 10),  # nested compute: 50..70 once
              ev("autograd::engine::evaluate_function: MmBackward0", 0, 100)])  # a wrapper, not an aten op
    assert (o.comm_ms, o.overlapped_ms) == (60.0, 20.0) and o.fraction == pytest.approx(1 / 3)


def test_aten_op_holding_a_collective_is_not_compute():
    # a DTensor norm all-reduces and waits inside its aten span; only its own child op computes
    o = only([step(3), ev("aten::linalg_vector_norm", 10, 60), ev("_c10d_functional::all_reduce", 15, 3),
              ev("aten::abs", 20, 10), ev("gloo:all_reduce", 20, 40, WORKER, "user_annotation")])
    assert (o.comm_ms, o.overlapped_ms, o.fraction) == (40.0, 10.0, 0.25)


def test_collective_on_the_main_thread_only_overlaps_nothing():
    o = only([step(3), ev("c10d::allreduce_", 20, 40), ev("aten::copy_", 30, 10)])
    assert (o.comm_ms, o.overlapped_ms, o.fraction) == (40.0, 0.0, 0.0)


def test_device_collective_fully_under_a_compute_kernel_on_another_stream():
    events = [step(3), ev("usp_step_3", 5, 95, tid=7, pid=0, cat="gpu_user_annotation"),  # device copy: ignored
              ev("c10d::allreduce_", 80, 2), ev("cudaLaunchKernel", 90, 1, cat="cuda_runtime", correlation=7),
              # launched inside step 3 but runs after its CPU span: still step 3's
              ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 110, 40, tid=20, pid=0, cat="kernel", correlation=7),
              ev("nccl:all_reduce", 110, 40, tid=20, pid=0, cat="gpu_user_annotation"),
              ev("sm90_xmma_gemm_f32", 100, 60, tid=7, pid=0, cat="kernel", correlation=8)]
    o = only(events)
    assert (o.comm_ms, o.overlapped_ms, o.fraction, o.source) == (40.0, 40.0, 1.0, "device kernels")
    events[-1] = ev("sm90_xmma_gemm_f32", 150, 10, tid=7, pid=0, cat="kernel", correlation=8)  # after it: none
    assert only(events).fraction == 0.0


def test_no_communication_gives_nothing_and_a_quiet_step_gives_none():
    assert step_overlaps([step(3), ev("aten::mm", 0, 40)], rank=0) == []
    quiet, busy = step_overlaps([step(3), step(4, 100), ev("gloo:all_reduce", 120, 10, WORKER, "user_annotation"),
                                 ev("aten::mm", 100, 25)], rank=1)
    assert (quiet.step, quiet.comm_ms, quiet.fraction) == (3, 0.0, None)
    assert (busy.step, busy.rank, busy.comm_ms, busy.overlapped_ms, busy.fraction) == (4, 1, 10.0, 5.0, 0.5)
    t = totals([quiet, busy])  # fraction over all steps: sum overlapped / sum communication
    assert (t["comm_ms_per_step"], t["overlapped_ms_per_step"], t["fraction"]) == (5.0, 2.5, 0.5)


def test_report_lines_one_row_per_rank(tmp_path):
    traces = {}
    for rank, covered in ((0, 40), (1, 10)):
        traces[rank] = tmp_path / f"rank_{rank}.json"
        traces[rank].write_text(json.dumps({"traceEvents": [
            step(3), ev("aten::mm", 20, covered), ev("gloo:all_reduce", 20, 40, WORKER, "user_annotation")]}))
    md = "\n".join(overlap_markdown(SimpleNamespace(label="run", traces=traces)))
    assert "| 0 | 3 | CPU threads | 40.0 | 40.0 | 100% |" in md and "| 1 | 3 | CPU threads | 40.0 | 10.0 | 25% |" in md
    assert overlap_markdown(SimpleNamespace(label="run", traces={})) == []
