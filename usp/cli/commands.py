"""usp command line. One small function per command; the work happens in usp.config,
usp.plan, usp.data and usp.launch. Only typer is imported at module level so that
`usp --help` stays fast. torch is imported only inside the commands that run the engine in this
process: `usp export` (usp.engine.export), and `usp train` and `usp verify` of one rank (the worker
runs in-process); every other command runs without it."""
from __future__ import annotations

import functools
from typing import NoReturn

import typer

from usp.cli.examples import add_examples

# add_completion: `usp --install-completion` / `--show-completion` (bash, zsh, fish, PowerShell)
app = typer.Typer(no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,
                  help="usp: YAML in, a checked parallel run plan out, then torchrun or Slurm.")
config_app = typer.Typer(no_args_is_help=True, help="Browse and copy the config catalogue.")
app.add_typer(config_app, name="config")
checkpoints_app = typer.Typer(no_args_is_help=True, help="Check a run's checkpoints.")
app.add_typer(checkpoints_app, name="checkpoints")

ForceOption = typer.Option(False, "--force", help="replace an existing output (the old one is kept until the new "
                                                   "one is complete)")
OVERRIDES_HELP = ("conf=<name or recipe.yaml> and Hydra overrides: key=value, +key=value (add), "
                  "~key (delete), group=option (e.g. model=tiny parallelism=ddp)")


def _complete_override(incomplete: str) -> list[str]:
    from usp.config.catalogue import complete_override

    return complete_override(incomplete)


Overrides = typer.Argument(None, help=OVERRIDES_HELP, show_default=False, autocompletion=_complete_override)
CfgOption = typer.Option(None, "--cfg", help="print the composed config ('job') and exit without running")


def _fail(exc: Exception) -> NoReturn:
    from rich.console import Console
    from rich.markup import escape

    # escaped: a value such as [10, 12] or a fix's [...] is text, not rich markup
    Console(stderr=True).print(f"[bold red]error:[/] {escape(str(exc))}", markup=True, highlight=False)
    raise typer.Exit(2)


def _split_conf(overrides: list[str] | None) -> tuple[str | None, list[str]]:
    conf, rest = None, []
    for item in overrides or []:
        if item.startswith("conf="):
            conf = item.split("=", 1)[1]
        else:
            rest.append(item)
    return conf, rest


def _compose(overrides: list[str] | None):
    from usp.config.compose import compose_config

    return compose_config(*_split_conf(overrides))


def _print_cfg(cfg, which: str) -> None:
    from omegaconf import OmegaConf

    if which not in ("job", "all"):
        _fail(ValueError(f"--cfg {which!r}: use --cfg job"))
    typer.echo(OmegaConf.to_yaml(cfg, resolve=False), nl=False)


def _user_errors():
    from usp.errors import UspError  # the data layer's DataError is one too

    return UspError


def _nothing_to_do():
    from usp.launch.checkpoints import RunAlreadyDone

    return RunAlreadyDone


def handles_errors(command):
    """The one error wrapper of every command: a problem the user can fix (a UspError) is printed
    as one red line (with its fix) and exits 2, never as a stack trace. A run that is already at
    train.steps says so and exits 0. Ctrl-C before any rank runs (planning, preparing data, importing
    torch) is one line and exit code 130 (once ranks run, usp/launch/stop_signals.py handles it)."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except _user_errors() as exc:  # evaluated only when something was raised: no import cost
            _fail(exc)
        except _nothing_to_do() as done:
            typer.echo(str(done))
            raise typer.Exit(0) from None
        except KeyboardInterrupt:
            from usp.run.files import EXIT_INTERRUPTED

            typer.echo("usp: interrupted (SIGINT)", err=True)
            raise typer.Exit(EXIT_INTERRUPTED) from None

    return wrapper


BUILD_CHECK_HELP = ("build the parallel model of the ranks among the arguments (integers; default: the first rank "
                    "of each pipeline stage and the last) for real, on the meta device under a fake process group: "
                    "no GPU, no data, nothing allocated; print each rank's parameter, gradient and optimizer-state "
                    "bytes next to the plan's (needs torch here)")


HTML_HELP = ("also write the plan as one self-contained HTML page (charts, schedule, mesh; with --search: the best "
             "layout's, the ranking above it; needs usp[ui])")


def _split_ranks(overrides: list[str] | None) -> tuple[list[int], list[str]]:
    """--build-check's ranks (the bare integers: no override is one) and the overrides."""
    items = overrides or []
    return [int(x) for x in items if x.isdigit()], [x for x in items if not x.isdigit()]


def _build_check(run_plan, ranks: list[int], failures: list) -> None:
    """usp plan --build-check: one line per rank as the engine builds it, then the table."""
    from rich.console import Console

    from usp.errors import LaunchError
    from usp.launch.build_check import check_ranks, run_build_check
    from usp.plan.planner_inputs import planned_local_bytes
    from usp.plan.render import build_check_summary, build_check_table, render_refusals

    console = Console()
    ranks = check_ranks(run_plan, ranks)
    planned = planned_local_bytes(run_plan, ranks)
    console.print(f"building rank(s) {', '.join(map(str, ranks))} of {run_plan.world_size} on the meta device ...")
    results = run_build_check(run_plan, ranks, on_result=lambda r: console.print(
        f"  rank {r['rank']}: {'built' if 'error' not in r else 'FAILED'} in {r['seconds']:.1f} s", highlight=False))
    console.print(build_check_table(run_plan, results, planned))
    render_refusals(failures)
    console.print(build_check_summary(results, planned), highlight=False)
    failed = [r for r in results if "error" in r]
    if failed:
        first = failed[0]
        raise LaunchError(f"the plan passed every rule, but the engine can't build it: {len(failed)} of "
                          f"{len(results)} rank(s) failed; rank {first['rank']}: {first['error']}\n"
                          f"{first.get('trace', '')}", key="parallelism",
                          value=run_plan.parallel.describe(),
                          fix="what the error names; if it is the engine's own, a rule is missing: please report "
                              "the layout")


@app.command()
@handles_errors
def plan(overrides: list[str] | None = Overrides, cfg: str | None = CfgOption,
         save: bool = typer.Option(False, "--save", help="also write runs/<name>/plan.yaml"),
         strict: bool = typer.Option(False, "--strict", help="a TP group spanning nodes is an error, not a warning"),
         force: bool = typer.Option(False, "--force", help="plan even if the layout is predicted not to fit"),
         search: bool = typer.Option(False, "--search", help="rank the layouts that fit by predicted throughput"),
         top: int = typer.Option(5, "--top", help="with --search: how many layouts to show"),
         build_check: bool = typer.Option(False, "--build-check", help=BUILD_CHECK_HELP),
         json_out: bool = typer.Option(False, "--json", help="print the plan as JSON (plan.yaml's fields) instead "
                                                             "of the tables"),
         html: str | None = typer.Option(None, "--html", help=HTML_HELP)) -> None:
    """Resolve the config into a run plan and print it; launches nothing."""
    from usp.plan.plan import plan_with_failures

    if json_out and (search or build_check):
        from usp.errors import UspError

        raise UspError("--json prints the plan alone; --search and --build-check print tables", key="--json",
                       value=True, fix="drop --json (--search --html FILE writes the best layout's page)")
    ranks, overrides = _split_ranks(overrides) if build_check else ([], overrides)
    composed, choices = _compose(overrides)
    if cfg:
        return _print_cfg(composed, cfg)
    if search:
        return _search(composed, top, html, list(overrides or []))
    run_plan, failures = plan_with_failures(composed, choices, force=force, strict=strict)
    if run_plan is None:  # every failing rule, not just the first
        for error in failures[:-1]:
            typer.echo(f"error: {error}", err=True)
        _fail(failures[-1])
    if build_check:
        return _build_check(run_plan, ranks, failures)
    _show_plan(run_plan, failures, json_out, html, list(overrides or []))
    if save:
        from pathlib import Path

        from usp.contract.plan_file import write_plan
        from usp.run.lock import refuse_if_locked
        from usp.run.writable import check_writable_dir

        refuse_if_locked(run_plan.run_dir, "plan --save")  # a live run's checkpoints copy its plan.yaml
        check_writable_dir(Path(run_plan.run_dir), "train.runs_dir", composed.train.runs_dir,
                           "train.runs_dir=<a writable directory>")
        typer.echo(f"plan written to {write_plan(run_plan)}", err=json_out)


def _search(composed, top: int, html: str | None, overrides: list[str]) -> None:
    """usp plan --search; with --html, the page of the best layout's plan with the ranking above it."""
    from usp.plan.search import run_search

    result = run_search(composed, top)
    if html and result.best is not None:
        from usp.plan.plan import plan_with_failures
        from usp.view.plan_output import write_plan_page

        args = [*overrides, *result.best.layout.overrides()]
        best, failures = plan_with_failures(*_compose(args))
        if best is None:  # the search proposes only layouts that pass every rule
            _fail(failures[-1])
        typer.echo(f"plan page written to {write_plan_page(best, failures, args, html, search=result)}")


def _show_plan(run_plan, failures: list, json_out: bool, html: str | None, overrides: list[str]) -> None:
    """usp plan's tables, or --json's JSON alone on stdout; --html's page."""
    if json_out:
        from usp.view.plan_output import plan_json

        typer.echo(plan_json(run_plan))
        for error in failures:
            typer.echo(f"usp train would refuse: {error}", err=True)
    else:
        from usp.plan.render import render_plan, render_refusals

        render_plan(run_plan)
        render_refusals(failures)
    if html:
        from usp.view.plan_output import write_plan_page

        typer.echo(f"plan page written to {write_plan_page(run_plan, failures, overrides, html)}", err=json_out)


@app.command()
@handles_errors
def ui(host: str = typer.Option("127.0.0.1", "--host", help="the address to listen on; another than loopback needs "
                                                            "--token"),
       port: int = typer.Option(8765, "--port", help="the port (0: a free one)"),
       token: str | None = typer.Option(None, "--token", envvar="USP_UI_TOKEN",
                                        help="a secret every request must carry (needed off loopback)"),
       conf: str = typer.Option("tiny_demo", "--conf", help="the recipe the page opens with")) -> None:
    """A local web page that plans as you pick a recipe, a model, a cluster, a layout and overrides (usp[ui])."""
    from usp.view.ui_server import serve

    def ready(url: str) -> None:
        typer.echo(f"usp ui: {url}  (Ctrl-C stops it)")

    serve(host, port, token, conf, ready)


@app.command()
@handles_errors
def calibrate(measured: str = typer.Argument(..., help="a runs CSV (like calibration/published_runs.csv or "
                                               "calibration/playbook_h100/playbook_sweep_calibration.csv; its columns: "
                                               "docs/planner.md) or a directory of usp runs"),
              cluster: str = typer.Option(..., "--cluster", help="the cluster group to fit: a name in conf/cluster "
                                                                  "or a YAML path (also the runs' default)"),
              profile: str = typer.Option("usp", "--profile", help="the stack the runs were trained with, where a row "
                                                                    "names none (planner.profile: usp | nanotron | "
                                                                    "megatron | torchtitan | ...)"),
              fit_groups: str = typer.Option("network,stack", "--fit", help="what to fit: network (the cluster's "
                                                                             "latencies), gpu (its matmul "
                                                                             "efficiency, kernel cost, "
                                                                             "interference), stack (the profile's "
                                                                             "constants)"),
              out: str | None = typer.Option(None, "--out", help="write the fitted cluster group here (e.g. "
                                                                  "conf/cluster/mine.yaml); default: print it"),
              profile_out: str | None = typer.Option(None, "--profile-out", help="write the fitted stack constants "
                                                                                  "here (a profile file; default: "
                                                                                  "<out>.<profile>.yaml beside --out)"),
              archs: str | None = typer.Option(None, "--archs", help="model shapes of a CSV (default: "
                                                                      "playbook_model_archs.csv beside it)"),
              holdout: int = typer.Option(0, "--holdout", help="hold every N-th run out of the fit and score it "
                                                                "separately"),
              force: bool = ForceOption) -> None:
    """Fit the time model's constants to measured runs: the cluster's network latencies (and GPU constants),
    the stack's own constants; report the residuals, write the cluster group and the profile file."""
    from pathlib import Path

    from usp.perf.calibration.calibrate import TooFewRuns, parse_groups, report
    from usp.perf.calibration.calibrate import calibrate as fit_cluster
    from usp.perf.calibration.measured_runs import archs_csv
    from usp.perf.calibration.restarts import restart_costs_only, restart_costs_yaml
    from usp.run.writable import check_new_output

    stack_out = profile_out or (str(Path(out).with_suffix(f".{Path(profile).stem}.yaml")) if out else None)
    if "stack" not in parse_groups(fit_groups):
        stack_out = None
    read = [Path(measured)] + ([archs_csv(Path(measured), archs)] if Path(measured).is_file() else [])
    for target, key in ((out, "--out"), (stack_out, "--profile-out")):
        if target:  # before the fit; the runs (and archs) CSV are read too, given or not
            check_new_output(target, force=force, key=key, inputs=read)
    try:
        result = fit_cluster(Path(measured), cluster, profile, Path(archs) if archs else None, holdout, fit_groups)
    except TooFewRuns as exc:
        if not Path(measured).is_dir():
            raise
        typer.echo(f"time model not fitted: {exc}")  # a directory of runs: its restart costs still fit
        restarts, lines = restart_costs_only(Path(measured), cluster)
        typer.echo("\n".join(lines))
        _write_calibration(restarts, out, None)
        return
    for line in report(result):
        typer.echo(line)
    if Path(measured).is_dir():  # run directories: their restart and checkpoint costs too (docs/faults.md)
        result.yaml, lines = restart_costs_yaml(Path(measured), cluster, result.yaml)
        typer.echo("\n".join(lines))
    for warning in result.warnings:
        typer.echo(f"warning: {warning}", err=True)
    _write_calibration(result, out, stack_out)


def _write_calibration(result, out: str | None, stack_out: str | None) -> None:
    """`usp calibrate`'s outputs: the cluster group and the profile file, or both printed."""
    from pathlib import Path

    from usp.run.files import write_text_atomic

    if out:
        write_text_atomic(Path(out), result.yaml)
        typer.echo(f"cluster group written to {out}")
    if stack_out and result.profile_yaml:
        write_text_atomic(Path(stack_out), result.profile_yaml)
        typer.echo(f"stack constants written to {stack_out}")
    if out:
        use = f" planner.profile={stack_out}" if stack_out and result.profile_yaml else ""
        typer.echo(f"use it: usp plan {cluster_override(out)}{use} (or usp train, usp estimate; any command that "
                   "takes cluster=)")
    else:
        typer.echo(result.yaml + (f"---\n{result.profile_yaml}" if result.profile_yaml else ""))


def cluster_override(out: str) -> str:
    """The cluster= override that selects a written cluster group: its name inside conf/cluster, else
    its path (with ./ where the path alone would read as a name)."""
    from pathlib import Path

    from usp.config.paths import conf_dir

    path = Path(out).expanduser()
    if path.resolve().parent == conf_dir() / "cluster" and path.suffix == ".yaml":
        return f"cluster={path.stem}"
    shown = str(path) if "/" in str(path) or path.suffix in (".yaml", ".yml") else f"./{path}"
    return f"cluster={shown}"


@app.command()
@handles_errors
def estimate(overrides: list[str] | None = Overrides,
             hours: float | None = typer.Option(None, "--hours", help="wall-clock budget: how many devices?"),
             gpus: int | None = typer.Option(None, "--gpus", "--devices", help="device count: how many hours?"),
             mfu: float | None = typer.Option(None, "--mfu", help="MFU to assume instead of planning each size"),
             scaling: bool = typer.Option(False, "--scaling", help="the best layout per node count, strong and weak "
                                                                   "scaling, and their efficiency"),
             max_nodes: int | None = typer.Option(None, "--max-nodes", help="--scaling: the largest node count "
                                                  "(default: the quoted one, else cluster.nodes x 16)"),
             plot: str | None = typer.Option(None, "--plot", help="--scaling: also write the table as a PNG heatmap")
             ) -> None:
    """Devices, hours and cost for a token budget (train.tokens=...), planned at the size quoted: the best
    layout `usp plan` accepts there. --scaling: throughput by node count."""
    from usp.plan.estimate_view import run_estimate, run_scaling

    composed, choices = _compose(overrides)
    if plot and not scaling:
        _fail(ValueError("--plot draws the --scaling table: add --scaling"))
    est = run_estimate(composed, choices, hours=hours, gpus=gpus, mfu=mfu, command=list(overrides or []))
    if scaling:
        rows = run_scaling(composed, choices, max_nodes or est.nodes or composed.cluster.nodes * 16)
        if plot:
            from pathlib import Path

            from usp.report.scaling_plot import plot_scaling

            typer.echo(f"scaling plot written to {plot_scaling(rows, est.model, Path(plot))}")


DryRunOption = typer.Option(False, "--dry-run", help="Slurm: write runs/<name>/job.sbatch and print it; submit nothing")


@app.command()
@handles_errors
def train(overrides: list[str] | None = Overrides, cfg: str | None = CfgOption,
          dry_run: bool = DryRunOption) -> None:
    """Plan, prepare the data if needed, and train: here (in-process for one rank, torchrun for
    several), or as a Slurm job when the cluster group says launcher: slurm."""
    from usp.launch.pre_launch import prepare_run

    composed, choices = _compose(overrides)
    if cfg:
        return _print_cfg(composed, cfg)
    if composed.cluster.launcher == "slurm":
        return _submit(composed, choices, overrides, dry_run, "train")
    if dry_run:
        _fail(ValueError("--dry-run writes a Slurm batch script: use a Slurm cluster group "
                         "(e.g. cluster=local_slurm or cluster=slurm_h100)"))
    from usp.launch.local import check_launchable, launch_local, require_torch
    from usp.run.lock import release

    require_torch("train")
    run_plan, plan_path = prepare_run(composed, choices, check=check_launchable)  # holds the run lock from here on

    failure = None
    try:
        if run_plan.fault_tolerance is not None:  # one torchrun per replica group, and torchft's lighthouse
            from usp.launch.ft_local import launch_replica_groups

            code = launch_replica_groups(run_plan, plan_path)
        else:
            code = launch_local(run_plan, plan_path)
    except Exception as exc:  # one rank runs in-process: the same summary as torchrun's below
        failure, code = exc, 1
    finally:
        release(run_plan.run_dir)
    if code:
        _say_why(run_plan.run_dir, code, failure)
    raise typer.Exit(code)


def _say_why(run_dir, code: int, failure: Exception | None) -> None:
    """After a failed run: the root cause from logs/failure_rank*.json first, then one line saying
    where the tracebacks are (the ranks' own stay in the logs). Without a failure record, the
    in-process rank's error as it is. A stop on a signal: the ranks or the launcher said so."""
    from usp.launch.status import print_failure_summary
    from usp.run.files import STOP_CODES, logs_dir

    if code in STOP_CODES:
        return
    if not print_failure_summary(run_dir) and failure is not None:
        if isinstance(failure, _user_errors()):  # e.g. a full disk (usp.engine.diskfull): its message says it all
            typer.echo(f"error: {failure}", err=True)
        else:
            import traceback

            traceback.print_exception(failure)
    typer.echo(f"usp: training exited with code {code}; tracebacks and per-rank logs in {logs_dir(run_dir)}", err=True)


@app.command()
@handles_errors
def submit(overrides: list[str] | None = Overrides, dry_run: bool = DryRunOption) -> None:
    """Plan the run and submit it to Slurm (sbatch); prints the job id and where the logs go."""
    composed, choices = _compose(overrides)
    if composed.cluster.launcher != "slurm":
        from usp.errors import LaunchError

        raise LaunchError("usp submit needs a Slurm cluster group", key="cluster.launcher",
                          value=composed.cluster.launcher, fix="cluster=local_slurm (or slurm_h100, ...), "
                          "or `usp train` to run here")
    _submit(composed, choices, overrides, dry_run, "submit")


def _submit(composed, choices, overrides, dry_run: bool, verb: str) -> None:
    from usp.launch.pre_launch import prepare_run
    from usp.launch.submit import check_submittable, submit_run

    run_plan, plan_path = prepare_run(composed, choices, prepare_data=not dry_run, check=check_submittable,
                                      hold_lock=False)
    submit_run(run_plan, plan_path, ["usp", verb, *(overrides or [])], dry_run=dry_run)


@app.command()
@handles_errors
def cancel(run_dir: str | None = typer.Argument(None, help="run or sweep directory "
                                                          "(default: the newest under ./runs)")) -> None:
    """Cancel the run's Slurm job (scancel; every task of a sweep's job array)."""
    from usp.launch.jobs import cancel_run

    cancel_run(run_dir)


@app.command()
@handles_errors
def logs(run_dir: str | None = typer.Argument(None, help="run directory (default: the newest under ./runs)"),
         rank: int | None = typer.Option(None, "--rank", help="this rank's log (default: the job's batch output)"),
         tail: int = typer.Option(0, "--tail", help="only the last N lines (0 = all)"),
         follow: bool = typer.Option(False, "--follow", "-f",
                                     help="keep printing as the log grows (Ctrl-C stops)")) -> None:
    """Print a run's log: the Slurm batch output (torchrun and rank 0), or one rank's log."""
    from usp.launch.jobs import show_logs

    show_logs(run_dir, rank=rank, tail=tail, follow=follow)


@app.command()
@handles_errors
def status(run_dir: str | None = typer.Argument(None, help="run directory (default: the newest under ./runs)")) -> None:
    """State of a run: progress, checkpoints, restarts, and the root cause if it failed (exit 1)."""
    from usp.launch.status import show_status

    code = show_status(run_dir)
    raise typer.Exit(code)


@checkpoints_app.command("verify")
@handles_errors
def checkpoints_verify(run_dir: str | None = typer.Argument(None, help="run directory, its checkpoint directory or "
                                                            "one step_<N> directory (default: the newest run)"),
                       step: int | None = typer.Option(None, "--step", help="only this step's checkpoint")) -> None:
    """Check every file of a run's checkpoints against the checksums saved with it: verified, unverified
    (saved without checksums), damaged (names the file) or incomplete. Exit 1 if one can't be used."""
    from usp.launch.checkpoint_check import verify

    raise typer.Exit(verify(run_dir, step))


@app.command()
@handles_errors
def export(run_dir: str = typer.Argument(..., help="run directory (or one step_<N> checkpoint directory)"),
           step: int | None = typer.Option(None, "--step", help="checkpoint step (default: the newest complete)"),
           out: str | None = typer.Option(None, "--out", help="output directory: model.pt or model.safetensors + "
                                          "config.json, or the hf files (default: <run dir>/export/<format>_step<N>)"),
           fmt: str = typer.Option("torch", "--format",
                                   help="torch (torch.load) | safetensors | hf (a transformers directory)"),
           shard_mb: float | None = typer.Option(None, "--shard-mb", help="largest weights file, MiB (default 5000); "
                                                 "a bigger model is split into files with an index. The export holds "
                                                 "one file's tensors in memory at a time, never the model"),
           force: bool = ForceOption) -> None:
    """Write the model from a checkpoint into a new directory: one consolidated state dict (full tensors,
    FQN keys) + config.json, or (--format hf) what transformers' AutoModelForCausalLM.from_pretrained loads.
    Streamed: one tensor read at a time, one file of at most --shard-mb in memory at a time."""
    from usp.launch.local import require_torch

    require_torch("export")
    from usp.engine.export import export_model  # imports torch: only for this command

    result = export_model(run_dir, step=step, out=out, fmt=fmt, max_shard_mb=shard_mb, force=force)
    typer.echo(result.describe())


@app.command()
@handles_errors
def verify(overrides: list[str] | None = Overrides,
           steps: int = typer.Option(5, help="optimizer steps to compare"),
           rtol: float = typer.Option(1e-5, help="relative loss tolerance per step"),
           param_atol: float = typer.Option(1e-4, help="absolute tolerance on the final parameters")) -> None:
    """Run a layout at small scale next to a single-process reference and compare them step by step."""
    from usp.launch.local import require_torch
    from usp.launch.verify import verify as run

    require_torch("verify")
    conf, rest = _split_conf(overrides)
    code = run(conf, rest, steps, rtol, param_atol)
    raise typer.Exit(code)


@app.command("prepare-data")
@handles_errors
def prepare_data(overrides: list[str] | None = Overrides,
                 clean: bool = typer.Option(False, "--clean", help="then remove stale cache entries: older versions "
                                            "of this dataset, unused shards and tokenizers, temp dirs")) -> None:
    """Tokenize the data group's corpus once (tokenizer + uint16/uint32 train/val token files)."""
    from rich.console import Console
    from rich.markup import escape

    from usp.data.tokenized import ensure_dataset

    composed, _ = _compose(overrides)
    console = Console()
    path, meta = ensure_dataset(composed.data, progress=lambda msg: console.print(f"[dim]data:[/] {msg}"),
                                show_progress=console.is_terminal,
                                warn=lambda msg: console.print(f"[yellow]warning:[/] {escape(msg)}", highlight=False))
    console.print(f"dataset ready: {path}\n  {meta['n_train_tokens']:,} train tokens, "
                  f"{meta['n_val_tokens']:,} validation tokens, vocab {meta['vocab_size']}, {meta['dtype']}")
    if clean and composed.data.source != "token_files":
        from usp.data.clean import clean_caches

        removed = clean_caches(composed.data, keep=path)
        console.print(f"removed {len(removed)} stale cache entries" + "".join(f"\n  {p}" for p in removed),
                      highlight=False)


@config_app.command("list")
@handles_errors
def config_list() -> None:
    """Config groups with their options, and the recipes."""
    from usp.config.catalogue import render_catalogue

    render_catalogue()


@config_app.command("show")
@handles_errors
def config_show(item: str = typer.Argument(..., help="group=option (e.g. model=tiny) or a recipe name/path")) -> None:
    """Print one group option or recipe, composed with the schema defaults."""
    from usp.config.catalogue import show_item

    typer.echo(show_item(item), nl=False)


@config_app.command("cp")
@handles_errors
def config_cp(recipe: str = typer.Argument(..., help="recipe name (see `usp config list`)"),
              dest: str = typer.Argument(".", help="file or directory to copy to"),
              force: bool = ForceOption) -> None:
    """Copy a recipe into the working directory to edit it; run it with conf=<file>."""
    from usp.config.catalogue import copy_recipe

    path = copy_recipe(recipe, dest, force=force)
    typer.echo(f"copied to {path}; run it with: usp train conf={path}")


@app.command()
@handles_errors
def sweep(overrides: list[str] | None = typer.Argument(None, show_default=False, help=(
              OVERRIDES_HELP + "; a comma list sweeps a key: train.micro_batch=4,8,16 parallelism.tp=1,2")),
          name: str | None = typer.Option(None, "--name", help="sweep directory runs/<name>/ "
                                             "(default: sweep-<date>-<time>); the same name again resumes it"),
          dry_run: bool = typer.Option(False, "--dry-run", help="plan every point, write sweep.json (and the Slurm "
                                       "array script), run nothing"),
          max_parallel: int = typer.Option(0, "--max-parallel",
                                           help="Slurm: at most N array tasks at once (0 = no limit)")) -> None:
    """Plan the grid of the comma-list overrides and train every point the planner accepts: one
    after another here, or as one Slurm job array with a Slurm cluster group; rejected points are
    listed with the reason and skipped."""
    import time

    from usp.launch.sweep import expand_grid, launch_sweep, plan_grid, render_sweep

    conf, rest = _split_conf(overrides)
    grid_sweep = plan_grid(conf, expand_grid(rest), name or time.strftime("sweep-%Y%m%d-%H%M%S"))
    render_sweep(grid_sweep)
    if not grid_sweep.accepted:
        typer.echo(f"usp sweep: the planner rejected all {len(grid_sweep.points)} points (reasons above); "
                   "change the swept values", err=True)
        raise typer.Exit(1)
    failed = launch_sweep(grid_sweep, max_parallel=max_parallel, dry_run=dry_run)
    if dry_run:
        return
    if grid_sweep.launcher == "slurm":
        typer.echo(f"{len(grid_sweep.accepted) - failed} point(s) submitted, {failed} could not be; "
                   f"when they have run: usp report {grid_sweep.dir}")
        raise typer.Exit(1 if failed else 0)
    render_sweep(grid_sweep)
    typer.echo(f"{failed} of {len(grid_sweep.accepted)} point(s) failed; report: usp report {grid_sweep.dir}")
    raise typer.Exit(1 if failed else 0)


@app.command()
@handles_errors
def report(paths: list[str] = typer.Argument(..., help="run directories and/or sweep directories", show_default=False),
           out: str | None = typer.Option(None, "--out", help="output directory "
                                             "(default: <first run or sweep dir>/report)"),
           force: bool = ForceOption) -> None:
    """Plots (loss, lr, throughput, memory, step time) and report.md for runs or a sweep (no torch)."""
    from usp.report import write_report

    result = write_report(paths, out, force=force)
    typer.echo(f"report: {result.markdown} ({len(result.plots)} plots)")


add_examples(app)


def main() -> None:  # pragma: no cover - console entry
    app(prog_name="usp")


if __name__ == "__main__":
    main()
