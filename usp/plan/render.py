"""Show a RunPlan as rich tables (what `usp plan` and `usp train` print before launching)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from usp.contract.config_schema import ModelConfig
from usp.contract.run_plan import PipelinePlan

MAX_RANK_ROWS = 16


def human(n: float, unit: str = "") -> str:
    for div, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g} {suffix}{unit}"
    return f"{n:.3g} {unit}".strip()


def _imported(plan) -> str:
    """Where an imported model's weights (and the keys no one set) come from."""
    source = plan.config.model.init_from
    return f", imported from {source} (shape: its config.json)" if source else ""


def render_plan(plan, console: Console | None = None) -> None:
    console = console or Console()
    b, m = plan.batch, plan.model
    summary = Table(title=f"run plan: {plan.name}", show_header=False, title_justify="left")
    summary.add_column(style="bold cyan")
    summary.add_column()
    layout = plan.parallel.describe()
    ep = plan.parallel.ep
    if ep > 1:
        layout += f", ep={ep} (experts over the dp_shard x cp ranks)"
    rows = [
        ("run dir", plan.run_dir),
        ("config", ", ".join(f"{g}={o}" for g, o in plan.choices.items() if o)),
        ("model", f"{m.name}: {human(m.params)} parameters, vocab {m.vocab_size}" + _imported(plan)),
        ("world", f"{plan.world_size} = {plan.nodes} node(s) x {plan.procs_per_node} process(es), "
                  f"{plan.device}/{plan.backend}, {plan.threads_per_proc} thread(s) each"),
        ("layout", layout),
        ("mesh", " x ".join(f"{d}:{s}" for d, s in zip(plan.mesh_dims, plan.mesh_shape))),
        ("batch", f"global {b.global_batch} seq x {b.seq_len} = {b.global_batch_tokens:,} tokens/step "
                  f"= micro {b.micro_batch} x grad-accum {b.grad_accum} x dp {b.dp}"),
        ("compute", f"{human(m.flops_per_token, 'FLOP')}/token (6N + 12·L·h·s), "
                    f"{human(m.flops_per_step, 'FLOP')}/step"),
        ("data", plan.dataset_dir or "not prepared (its source is not on this machine)"),
        ("checkpoints", checkpoint_summary(plan)),
        ("hangs", hang_summary(plan)),
        *([("moe", moe_summary(plan.config.model))] if plan.config.model.n_experts else []),
    ]
    for key, value in rows:
        summary.add_row(key, value)
    console.print(summary)
    console.print(rank_table(plan))
    if getattr(plan, "pipeline", None):
        console.print(pipeline_table(plan.pipeline))
    if getattr(plan, "memory", None) is not None:
        console.print(memory_table(plan.memory))
    if getattr(plan, "timing", None) is not None:
        console.print(timing_table(plan.timing))
    if getattr(plan, "goodput", None) is not None and plan.timing is not None:
        console.print(goodput_table(plan.goodput, plan.timing, plan.nodes))
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/] {warning}")


def render_refusals(errors: list, console: Console | None = None) -> None:
    """`usp plan`: the rules of kind "engine" this plan fails (usp.plan.rules): `usp train` refuses it."""
    console = console or Console()
    for error in errors:
        console.print(f"[bold red]usp train would refuse:[/] {error}", highlight=False)


def pipeline_table(pipe: PipelinePlan) -> Table:
    """Which layers each pipeline stage holds, and which pp rank runs it."""
    owner = {stage: rank for rank, stages in enumerate(pipe.rank_stages) for stage in stages}
    n = len(pipe.stage_layers)
    table = Table(title=f"pipeline: {pipe.schedule}, {n} stages, {pipe.n_microbatches} micro batches per step",
                  title_justify="left")
    for col in ("stage", "pp rank", "layers", "also holds"):
        table.add_column(col)
    for stage, layers in enumerate(pipe.stage_layers):
        extra = ", ".join(x for x, on in (("embedding", stage == 0), ("final norm + LM head", stage == n - 1)) if on)
        span = f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
        table.add_row(str(stage), str(owner[stage]), f"{span} ({len(layers)})", extra)
    return table


def checkpoint_summary(plan) -> str:
    ckpt = plan.config.checkpoint
    if not ckpt.enabled:
        return "off (checkpoint.enabled=false): the run can't resume"
    interval = int(ckpt.interval or 0)
    when = f"every {interval} steps and at the end" if interval > 0 else "at the end"
    return (f"{when}, keep {ckpt.keep_last}, {ckpt.async_mode} -> {plan.decisions.checkpoint_dir} "
            f"(resume: {ckpt.resume})")


def hang_summary(plan) -> str:
    """When a rank counts as hung (docs/hangs.md): the window, where it comes from, the phases' allowances."""
    hang = plan.decisions.hang
    if hang is None:
        if plan.world_size < 2:
            return "off: one process, no collective to hang in"
        return "off (train.hang_timeout_s=0)"
    return (f"{hang.step_s:.3g} s without a step dumps every rank's stack and stops the run ({hang.source}); "
            f"first step {hang.first_step_s:.3g} s, evaluation {hang.eval_s:.3g} s, checkpoint "
            f"{hang.checkpoint_s:.3g} s")


def moe_summary(model: ModelConfig) -> str:
    """A MoE model's routing and load balancing (docs/moe.md)."""
    rate, coef = float(model.router_bias_update_rate or 0.0), float(model.aux_loss_coef or 0.0)
    scope = "per sequence" if str(getattr(model, "aux_loss_scope", "batch")) == "sequence" else "over the global batch"
    balance = [f"aux loss x {coef:g} {scope}"] if coef > 0 else []
    balance += [f"aux-loss-free bias, rate {rate:g}"] if rate > 0 else []
    width = int(getattr(model, "n_shared_experts", 1) or 1)
    shared = (", 1 shared expert" + (f" ({width} experts wide)" if width > 1 else "")) if model.shared_expert else ""
    groups = int(getattr(model, "router_groups", 1) or 1)
    router = f"{getattr(model, 'router_score', 'softmax')} scores" + (
        f", the best {model.router_topk_groups} of {groups} groups" if groups > 1 else "")
    dense = int(getattr(model, "n_dense_layers", 0) or 0)
    return (f"{model.n_experts} experts, top-{model.top_k}{shared}; {router}"
            + (f"; the first {dense} block(s) dense" if dense else "")
            + f"; balancing: {' + '.join(balance) or 'none'}")


def rank_table(plan) -> Table:
    table = Table(title="ranks", title_justify="left")
    for col in ("rank", "node", "local rank", *plan.mesh_dims):
        table.add_column(col, justify="right")
    ranks = plan.ranks
    shown = ranks if len(ranks) <= MAX_RANK_ROWS else ranks[: MAX_RANK_ROWS // 2] + ranks[-MAX_RANK_ROWS // 2:]
    for i, r in enumerate(shown):
        if len(ranks) > MAX_RANK_ROWS and i == MAX_RANK_ROWS // 2:
            table.add_row("…", *[""] * (2 + len(plan.mesh_dims)))
        table.add_row(str(r.rank), str(r.node), str(r.local_rank), *(str(r.coords[d]) for d in plan.mesh_dims))
    if len(ranks) > MAX_RANK_ROWS:
        table.caption = (f"{len(ranks)} ranks; rank r runs on node r // {plan.procs_per_node}, its coordinates "
                         "row-major over the mesh")
    return table


# --- planner predictions (usp/perf/memory.py, timing.py, search.py) ------------------------------------

def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f}"


def memory_table(mem):
    """Memory per device by term, one column per pipeline stage that differs (GiB, predicted)."""
    from usp.contract.predictions import TERM_LABELS, TERMS

    stages = mem.distinct_stages()
    table = Table(title=f"memory per device, predicted (GiB; {mem.dtype}, {mem.device_name}: "
                        f"{mem.capacity_gib:g} GiB)", title_justify="left")
    table.add_column("term")
    for st in stages:
        last = st.first_rank + st.n_ranks - 1
        ranks = f"rank {st.first_rank}" if st.n_ranks == 1 else f"ranks {st.first_rank}-{last}"
        name = "all ranks" if len(mem.stages) == 1 else f"stage {st.stage} ({ranks})"
        table.add_column(name, justify="right")
    for term in TERMS:
        label = TERM_LABELS[term]
        if term == "activations":
            label += " (" + ", ".join(f"{st.in_flight:g}" for st in stages) + " micro batch(es) in flight)"
        table.add_row(label, *(_gib(getattr(st, term)) for st in stages))
    verdict = "fits" if mem.fits else "[bold red]OUT OF MEMORY[/]"
    table.add_row("[bold]total[/]", *(f"[bold]{_gib(st.total)}[/]" for st in stages))
    table.add_row("params on the rank (after TP/EP)", *(human(st.params) for st in stages))
    table.add_row("layers", *(str(st.layers) for st in stages))
    table.add_row("peak during", *(st.peak_phase for st in stages))
    _build_rows(table, stages)
    built = "fits" if mem.build_fits else "[bold red]OUT OF MEMORY[/]"
    return _with_notes(table, [f"peak {mem.peak_gib:.2f} GiB on stage {mem.peak_stage}: {verdict}; at build "
                               f"{mem.build_peak_gib:.2f} GiB on stage {mem.build_peak_stage}: {built}",
                               *mem.assumptions])


def _build_rows(table, stages) -> None:
    """While the engine builds (or loads) the rank's part, before training: usp.perf.memory.build_memory."""
    builds = [st.build for st in stages]
    if any(b is None for b in builds):  # a plan.yaml written before the build was planned
        return
    table.add_section()
    table.add_row("at build: parameters (this rank's, fp32)", *(_gib(b.parameters) for b in builds))
    table.add_row("at build: largest parameter made whole", *(_gib(b.transient) for b in builds))
    table.add_row("at build: framework overhead", *(_gib(b.overhead) for b in builds))
    table.add_row("[bold]at build: total[/]", *(f"[bold]{_gib(b.total)}[/]" for b in builds))
    table.add_row("largest parameter", *(f"{b.largest} ({human(b.largest_params)})" for b in builds))


def timing_table(tim):
    """Step time and its terms, throughput, MFU / HFU (predicted)."""
    table = Table(title=f"time per step, predicted ({tim.dtype}, peak {tim.peak_tflops:g} TFLOPS/device)",
                  title_justify="left")
    for col, just in (("term", "left"), ("value", "right"), ("how", "left")):
        table.add_column(col, justify=just)
    rows = [
        ("FLOPs / token", human(tim.model_flops_per_token, "FLOP"),
         f"6·N_active + 12·L·h·s; {human(tim.hw_flops_per_token, 'FLOP')} done by the hardware (recompute)"),
        ("tokens / step", f"{tim.tokens_per_step:,}", f"over {tim.world} device(s)"),
        ("kernel efficiency", f"{tim.efficiency:.2f}", "fraction of peak reached by the matmuls"),
        ("compute", f"{tim.compute_s:.4g} s", f"busiest pp rank: {tim.micro_batch_s:.4g} s per micro batch"),
        *_micro_batch_rows(tim),
    ]
    for c in tim.comm:
        if c.group <= 1:
            continue
        link = "inter-node" if c.crosses_nodes else "intra-node"
        hidden = f", {c.hidden:.3g} s hidden" if c.hidden else ""
        rows.append((c.name, f"{c.seconds:.4g} s",
                     f"{human(c.bytes_per_step, 'B')}/rank over {c.dims} ({c.group} ranks, {link} {c.gbps:g} GB/s), "
                     f"exposed {c.exposed_s:.4g} s{hidden}"))
    rows += [
        ("pipeline bubble", f"{tim.bubble_s:.4g} s", f"{tim.bubble_fraction:.3f} of the compute path"),
        *((name, f"{value:.4g} s", how) for name, value, how in (
            ("pipeline stall", tim.stall_s, "blocking sends/receives (in the exposed TP/CP/EP/PP)"),
            ("interference", tim.interference_s, "compute slowed by the communication it hides (in the exposed)"),
            ("gradient accumulation", tim.accumulation_s, "between micro batches"),
            ("optimizer step", tim.optimizer_s, "its states through HBM"),
            ("fixed per step", tim.step_overhead_s, "the stack's host cost per step")) if value),
        ("[bold]step[/]", f"[bold]{tim.step_s:.4g} s[/]",
         f"compute + exposed TP/CP/EP/PP {tim.exposed_path_comm_s:.3g} s + bubble + exposed DP "
         f"{tim.exposed_dp_comm_s:.3g} s + accumulation, optimizer, fixed {tim.fixed_s:.3g} s"),
        ("tokens / s", f"{tim.tokens_per_s:,.0f}", f"{tim.tokens_per_s_per_device:,.0f} per device"),
        ("[bold]MFU[/]", f"[bold]{tim.mfu:.1%}[/]", "model FLOPs / (step time x devices x peak)"),
        *_band_rows(tim),
        ("HFU", f"{tim.hfu:.1%}", "counting recomputed FLOPs"),
    ]
    for row in rows:
        table.add_row(*row)
    return _with_notes(table, [*tim.calibration, *tim.assumptions])


def _micro_batch_rows(tim) -> list[tuple]:
    """One micro batch on the busiest pp rank, by term (plans written before these terms: none)."""
    terms = (("matmuls", tim.gemm_s, "3 GEMMs per linear (+ the LM head on its stage)"),
             ("attention", tim.attention_s, "flash attention, 12·s·h/t FLOPs per token"),
             ("element-wise", tim.elementwise_s, "norms, RoPE, activation, residuals (+ FP8 casts) through HBM"),
             ("loss", tim.loss_s, "softmax cross-entropy through HBM"),
             ("host", tim.host_s, "launches per layer and micro batch"),
             ("recompute", tim.recompute_s, "what recomputation runs again"),
             ("eager", tim.eager_s, "eager blocks / loss over compiled ones (measured)"))
    return [(f"  {name}", f"{value:.4g} s", how) for name, value, how in terms if value]


def _duration(seconds: float) -> str:
    for div, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= div:
            return f"{seconds / div:.3g} {unit}"
    return f"{seconds:.3g} s"


def goodput_table(gp, tim, nodes: int):
    """Failures, checkpoint costs, the interval and the goodput (usp/perf/goodput.py)."""
    table = Table(title="failures and checkpoints, predicted (docs/faults.md)", title_justify="left")
    table.add_column("term")
    table.add_column("value", justify="right")
    table.add_column("how")
    terms = " + ".join(f"{k} {_duration(v)}" for k, v in gp.restart_terms.items())
    if gp.interval_steps == 0:
        interval = ("only at the end", "a failure loses the run so far")
    else:
        how = ("checkpoint.interval=auto: the Young–Daly interval √(2·save·MTBF)" if gp.interval_auto else
               f"checkpoint.interval; Young–Daly: {gp.young_daly_steps:,} steps ({_duration(gp.young_daly_s)})")
        interval = (f"{gp.interval_steps:,} steps", f"{_duration(gp.interval_s)} of training; {how}")
    rows = [
        ("failures / day", f"{gp.failures_per_day:.3g}",
         f"one every {_duration(gp.job_mtbf_s)}: node MTBF {gp.node_mtbf_hours:,.0f} h / {nodes:,} node(s)"),
        ("checkpoint", human(gp.written_bytes, "B"),
         f"written per save (parameters + optimizer states once); a load reads {human(gp.read_bytes, 'B')}"),
        ("save blocks", _duration(gp.save_blocking_s), f"the write takes {_duration(gp.save_write_s)}"),
        ("restart", _duration(gp.restart_s), terms),
        ("checkpoint every", *interval),
        ("lost per failure", _duration(gp.lost_per_failure_s), "the restart + half a checkpoint period"),
        ("[bold]goodput[/]" if gp.mode == "restart" else "goodput, restarting every rank",
         f"[bold]{gp.goodput:.1%}[/]" if gp.mode == "restart" else f"{gp.goodput:.1%}",
         "training time / wall time (Daly's model): every failure restarts the job"),
    ]
    if gp.torchft is not None:
        ft = gp.torchft
        chosen = gp.mode == "torchft"
        rows.append(("[bold]goodput with torchft[/]" if chosen else "goodput with torchft",
                     f"[bold]{ft.goodput:.1%}[/]" if chosen else f"{ft.goodput:.1%}",
                     f"{ft.groups} replica groups: a failure restarts one group ({_duration(ft.group_restart_s)}, "
                     f"healing {_duration(ft.heal_s)}) while the others train on"
                     + ("" if chosen else " (fault_tolerance=torchft)")))
    rows.append(("MFU x goodput", f"{tim.mfu * gp.expected:.1%}",
                 f"MFU {tim.mfu:.1%} over the wall time, failures counted"))
    for row in rows:
        table.add_row(*row)
    return _with_notes(table, gp.notes)


def _band_rows(tim) -> list[tuple]:
    """The calibrated uncertainty of MFU and tokens/s (none before `usp calibrate`)."""
    if tim.mfu_band is None:
        return [("MFU band", "-", "uncalibrated cluster: no band (`usp calibrate` fits one)")]
    lo, hi = tim.mfu_band
    tok = tim.tokens_per_s / tim.mfu if tim.mfu else 0.0
    return [("MFU band", f"{lo:.1%} - {hi:.1%}", "10th-90th percentile of the calibration's predicted/measured"),
            ("tokens / s band", f"{tok * lo:,.0f} - {tok * hi:,.0f}", "the same band")]


def _with_notes(table: Table, notes: list[str]):
    """A table followed by its assumptions, one dim line each."""
    from rich.console import Group
    from rich.text import Text

    return Group(table, *(Text.from_markup(f"[dim]  · {n}[/]") for n in notes))


def search_table(result) -> Table:
    """The top layouts of a search (usp plan --search)."""
    table = Table(title=f"best layouts for {result.model} on {result.world} device(s), seq {result.seq_len}, "
                        f"global batch {result.global_batch} (predicted)", title_justify="left")
    for col in ("#", "layout", "data parallel", "pipeline", "micro x accum", "max micro", "recompute",
                "peak GiB", "step s", "tokens/s/device", "MFU"):
        left = col in ("layout", "data parallel", "pipeline", "recompute")
        table.add_column(col, justify="left" if left else "right")
    for i, c in enumerate(result.top, 1):
        lay, tim = c.layout, c.timing
        virtual = f" v={lay.pp_virtual_stages}" if lay.pp_virtual_stages > 1 else ""
        pipe = "-" if lay.pp == 1 else lay.pp_schedule + virtual
        table.add_row(str(i), lay.label(), lay.dp_label(), pipe, f"{lay.micro_batch} x {lay.grad_accum}",
                      str(c.max_micro_batch), lay.recompute, f"{c.peak_gib:.1f}", f"{tim.step_s:.3g}",
                      f"{tim.tokens_per_s_per_device:,.0f}", f"{tim.mfu:.1%}")
    table.caption = (f"{result.fitting} fitting layouts of {result.evaluated} memory predictions, "
                     f"searched in {result.seconds:.2f} s")
    table.caption_justify = "left"
    return table


# --- usp plan --build-check (usp/launch/build_check.py) --------------------------------------------------

BUILD_CHECK_TOLERANCE = 0.01  # a rank's local bytes against the plan's


def build_check_differences(local, result: dict) -> dict[str, float]:
    """Relative difference of a built rank's local parameter / gradient / optimizer-state bytes from the
    planner's for that rank (`local`: usp.perf.memory.LocalBytes)."""
    out = {}
    for what, built in (("parameters", result["param_bytes"]), ("gradients", result["grad_bytes"]),
                        ("optimizer", result["optimizer_bytes"])):
        planned = getattr(local, what)
        out[what] = abs(built - planned) / planned if planned else float(built != 0)
    return out


def build_check_table(plan, results: list[dict], planned: dict):
    """Each checked rank: what its real (meta) build holds next to the planner's figures for it
    (`planned`: rank -> usp.perf.memory.LocalBytes, usp.plan.planner_inputs.planned_local_bytes)."""
    table = Table(title=f"build check: {len(results)} rank(s) built on the meta device under a fake process group "
                        f"of {plan.world_size} (built / planned)", title_justify="left")
    for col in ("rank", "pp", "parameters", "gradients", "optimizer states", "largest parameter", "its values", "s",
                ""):
        table.add_column(col, justify="left" if col in ("largest parameter", "") else "right")
    for r in results:
        if "error" in r:
            table.add_row(str(r["rank"]), str(r["pp"]), "", "", "", "", "", f"{r['seconds']:.1f}",
                          "[bold red]build failed[/]")
            continue
        st, local = plan.memory.stages[r["pp"]], planned[r["rank"]]
        worst = max(build_check_differences(local, r).values())
        verdict = "ok" if worst <= BUILD_CHECK_TOLERANCE else f"[yellow]differs by {worst:.1%}[/]"
        planned_largest = st.build.largest_params if st.build else 0
        table.add_row(str(r["rank"]), str(r["pp"]),
                      f"{_size(r['param_bytes'])} / {_size(local.parameters)}",
                      f"{_size(r['grad_bytes'])} / {_size(local.gradients)}",
                      f"{_size(r['optimizer_bytes'])} / {_size(local.optimizer)}", r["largest"],
                      f"{human(r['largest_elements'])} / {human(planned_largest)}", f"{r['seconds']:.1f}", verdict)
    return table


def _size(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


def build_check_summary(results: list[dict], planned: dict) -> str:
    """One line: how many ranks built, and the largest difference from the planner's figures."""
    built = [r for r in results if "error" not in r]
    worst = max((max(build_check_differences(planned[r["rank"]], r).values()) for r in built), default=0.0)
    line = f"build check: {len(built)} of {len(results)} rank(s) built"
    if built:
        line += f"; local bytes within {worst:.2%} of the plan (tolerance {BUILD_CHECK_TOLERANCE:.0%})"
    return line
