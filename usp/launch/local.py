"""Run a plan on this machine: in-process for one rank, torchrun for several.

No torch import here: torchrun is started as `python -m usp.engine.agent` (torchrun's own entry,
quiet on a stop signal), and the in-process path imports the engine only when it is called.

Stop signals (docs/signals.md): torchrun runs in a session of its own, so a terminal's Ctrl-C, a
signal to usp's process group and one to usp alone all reach usp alone, which passes SIGINT or
SIGTERM on to torchrun once (torchrun passes it to the ranks: usp/engine/signals.py); a second one
kills the ranks at once."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from usp.contract import decide
from usp.launch.rendezvous import is_multinode_local, rendezvous, torchrun_rendezvous_args
from usp.launch.stop_signals import StopForwarder
from usp.run.allocator import GLIBC_ENV, cpu_allocator_env, set_mmap_threshold
from usp.run.files import (
    EXIT_HUNG,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    FAILURE_GLOB,
    SUMMARY_BY_LAUNCHER_ENV,
    list_checkpoints,
    logs_dir,
    summary_path,
)
from usp.run.lock import TOKEN_ENV, held_token
from usp.run.state import hung_since, stopped_since

WORKER_MODULE = "usp.engine.worker"
AGENT_MODULE = "usp.engine.agent"  # torchrun's own entry, without its tracebacks on a stop signal or a failure
# How long torchrun waits for its ranks after passing on a stop signal, before it kills them: a step
# and a blocking checkpoint. A second signal to usp doesn't wait (usp/launch/stop_signals.py).
SHUTDOWN_TIMEOUT_S = 1800
TORCH_INSTALL = ("pip install torch (CPU only: pip install torch --index-url https://download.pytorch.org/whl/cpu; "
                 "a GPU build: https://pytorch.org/get-started/locally/)")


def require_torch(command: str) -> None:
    """Training and export run PyTorch here; planning doesn't. Checked before any work (data
    preparation), without importing torch."""
    from importlib.util import find_spec

    from usp.errors import LaunchError

    if find_spec("torch") is None:
        raise LaunchError(f"`usp {command}` runs PyTorch on this machine, and it is not installed in {sys.prefix}",
                          fix=f"{TORCH_INSTALL}; `usp plan`, `usp estimate` and `usp submit` work without it")


def worker_env(plan) -> dict[str, str]:
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in plan.config.cluster.env.items()})
    env.setdefault("OMP_NUM_THREADS", str(plan.threads_per_proc))
    env["PYTHONUNBUFFERED"] = "1"
    env[SUMMARY_BY_LAUNCHER_ENV] = "1"  # `usp train` prints the root cause: ranks and agent keep theirs in the logs
    # The ranks share torchrun's own store (its agent holds the port from the start: nothing to race
    # for), restarts included: each attempt keeps its keys under a prefix (usp/engine/parallel/mesh.py).
    env.update({k: v for k, v in plan_accelerator_env(plan, env).items() if k not in env})  # the user's setting wins
    token = held_token(plan.run_dir)
    if token:  # rank 0 keeps this launch's run lock alive (usp.run.lock)
        env[TOKEN_ENV] = token
    return env


def accelerator_env(device: str, deterministic: bool = False, user_env=None, weight_bytes=()) -> dict[str, str]:
    """The ranks' allocator and library settings for their device. CUDA: expandable segments let the
    caching allocator grow blocks instead of fragmenting (fewer OOMs at high memory use with varying
    shapes, as torchtitan recommends); with train.deterministic=true, the cuBLAS workspace setting
    its deterministic kernels need. CPU: glibc's mmap threshold while building, another while training
    (usp/run/allocator.py), unless `user_env` (what the ranks inherit) sets glibc's own."""
    if device == "cpu":
        return cpu_allocator_env(user_env if user_env is not None else os.environ, weight_bytes)
    if device != "cuda":
        return {}
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    if deterministic:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    return env


# torch's flight recorder: the last collectives of every process group, in a ring buffer per rank (gloo
# since torch 2.8, NCCL before), which the hang watchdog dumps (usp/engine/observe/flight_recorder.py).
FLIGHT_RECORDER_ENTRIES = 2000


def weight_matrix_bytes(plan) -> list[int]:
    """Bytes of each kind of weight matrix as a rank holds or gathers it (split over tp; experts per
    tensor of E/ep stacked experts), in the smaller of the dtypes it takes (bf16 gathers, fp32
    values): the parameter-sized blocks a CPU rank's training threshold must keep mapped."""
    from usp.perf.specs import Arch

    arch, deg = Arch.from_model(plan.config.model, plan.model.vocab_size), plan.degrees
    tp, ep = int(deg.get("tp", 1)), max(1, int(plan.config.parallelism.ep))
    values = [arch.dim * arch.q_dim, arch.dim * arch.kv_dim, arch.vocab_size * arch.dim]
    if arch.moe:
        values.append(arch.n_experts // ep * arch.dim * (arch.moe_ffn_dim or arch.ffn_dim))
    else:
        values.append(arch.dim * arch.ffn_dim)
    per_value = 2 if plan.decisions.bf16 else 4
    return [v * per_value // tp for v in values]


def cpu_memory_first(plan) -> bool:
    """usp.contract.decide.cpu_memory_first of the plan's layout."""
    ft = plan.fault_tolerance
    return decide.cpu_memory_first(plan.decisions.dp_kind, int(plan.config.parallelism.ep),
                                   int(plan.config.parallelism.pp), ft.group_dp_kind if ft is not None else None)


def plan_accelerator_env(plan, user_env=None) -> dict[str, str]:
    """The ranks' environment from the plan: accelerator_env, and torch's flight recorder where the
    hang watchdog is on. `user_env`: what the ranks inherit (default: this process's environment).
    A CPU rank's training threshold stays below its weight matrices only where it gathers them each
    step or pipelines (usp/run/allocator.py); elsewhere glibc's ceiling lets activations and logits be reused."""
    weights = weight_matrix_bytes(plan) if plan.device == "cpu" and cpu_memory_first(plan) else ()
    env = accelerator_env(plan.device, plan.decisions.deterministic, user_env, weights)
    if plan.decisions.hang is not None:
        env["TORCH_FR_BUFFER_SIZE"] = str(FLIGHT_RECORDER_ENTRIES)
    return env


def torchrun_command(plan, plan_path: Path, max_restarts: int = 0) -> list[str]:
    # one machine: a local c10d rendezvous on a free port; several: meet at node 0's endpoint
    nodes = torchrun_rendezvous_args(plan) if is_multinode_local(plan) else ["--standalone"]
    return [
        sys.executable, "-m", AGENT_MODULE, *nodes,
        f"--nproc-per-node={plan.procs_per_node}",
        f"--max-restarts={max_restarts}", f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}",
        "--module", WORKER_MODULE, "--plan", str(plan_path),
    ]


def check_launchable(plan) -> None:
    """Before anything is written: what this machine lacks for the plan (torchft for fault_tolerance=torchft)."""
    if plan.fault_tolerance is not None:
        from usp.launch.lighthouse import require_torchft

        require_torchft()


def launch_local(plan, plan_path: Path) -> int:
    """Run the plan here and return the exit code of the run: 0 = success; after a stop signal
    (run the same command again to resume) EXIT_INTERRUPTED (SIGINT, or stopped at once by a
    second signal) or EXIT_PREEMPTED (SIGTERM, SIGUSR1, SIGHUP)."""
    from usp.engine.observe.terminal import survive_a_lost_terminal

    survive_a_lost_terminal()  # a terminal that goes away stops the run (SIGHUP) instead of failing it
    if plan.world_size == 1:
        # before torch initialises CUDA; taken back afterwards, so that a later launch from this process (a
        # test's, a sweep's) does not inherit them as the user's own (a 32 MiB training threshold on FSDP ranks)
        added = {k: v for k, v in plan_accelerator_env(plan).items() if k not in os.environ}
        os.environ.update(added)
        set_mmap_threshold(os.environ.get(GLIBC_ENV))  # glibc read its variable when this process started
        token = held_token(plan.run_dir)
        if token:
            os.environ[TOKEN_ENV] = token
        from usp.engine.startup_gc import importing_torch

        with importing_torch():
            from usp.engine.worker import run_worker  # torch is imported only now, to train

        try:
            return run_worker(str(plan_path))
        finally:
            for key in (TOKEN_ENV, *added):
                os.environ.pop(key, None)
    if is_multinode_local(plan):
        rdzv = rendezvous(plan)
        print(f"usp: node {rdzv.node_rank} of {rdzv.nodes}, rendezvous {rdzv.endpoint} (run id {rdzv.run_id}); "
              f"waiting for the other nodes", file=sys.stderr, flush=True)
    cmd = torchrun_command(plan, plan_path, max_restarts=int(plan.config.train.max_restarts))
    started = time.time()
    # A session of its own: only usp passes signals on to torchrun, once (see the module's docstring).
    proc = subprocess.Popen(cmd, env=worker_env(plan), preexec_fn=_die_with_parent, start_new_session=True)
    with StopForwarder(proc) as stops:
        code = proc.wait()
    return _outcome(plan, code, started, stops)


def _outcome(plan, code: int, started: float, stops: StopForwarder) -> int:
    """The run's exit code, and a line where the ranks' own output doesn't say what happened.
    torchrun reports a worker's exit as 1 and its own stop signal as 128 + the signal: the ranks'
    stop is read from logs/events.jsonl (rank 0 printed it)."""
    run_dir = Path(plan.run_dir)
    stop = stopped_since(run_dir, started)
    if stop is not None:
        return EXIT_INTERRUPTED if stop.get("signal") == "SIGINT" else EXIT_PREEMPTED
    hang = hung_since(run_dir, started)
    if hang is not None:  # the watchdog's stop of a hung run that did not clear (docs/hangs.md)
        from usp.launch.hang_status import hang_line

        print(hang_line(run_dir, hang) + f"; the same command resumes from {_last_checkpoint(plan)}",
              file=sys.stderr, flush=True)
        return EXIT_HUNG
    if stops.first is None or _since(logs_dir(run_dir).glob(FAILURE_GLOB), started):
        return code  # a failure, even after a stop signal: `usp train` shows its root cause
    if _since([summary_path(run_dir)], started):
        print(f"usp: {stops.first} came as the run finished: it completed", file=sys.stderr, flush=True)
        return 0
    if stops.second:
        what = f"every rank was stopped at once by a second {stops.second}"
    else:  # torchrun got the signal before its ranks started training, or killed them after its wait
        what = (f"the ranks ended on {stops.first} without stopping at a step boundary (before training "
                f"started, or killed after {SHUTDOWN_TIMEOUT_S} s)")
    print(f"usp: {what}, without a checkpoint of the steps since the last one; the same command resumes from "
          f"{_last_checkpoint(plan)}", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def _since(paths, started: float) -> bool:
    """Any of `paths` written by this launch."""
    return any(p.is_file() and p.stat().st_mtime >= started - 1.0 for p in paths)


def _last_checkpoint(plan) -> str:
    complete = [c for c in list_checkpoints(plan.decisions.checkpoint_dir) if c.complete]
    return str(complete[-1][1]) if complete else "the start (no checkpoint yet)"


def _die_with_parent() -> None:
    """Linux: torchrun gets SIGTERM if usp itself is killed (even by SIGKILL), and stops the
    workers, so a killed launcher never leaves orphaned ranks behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass

