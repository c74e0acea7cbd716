"""The planner's entry: a composed config -> a RunPlan (usp/contract/run_plan.py), every rule checked,
every choice the engine acts on decided and recorded, the predictions attached."""
from __future__ import annotations

import os
from pathlib import Path

from omegaconf import OmegaConf

from usp.contract.config_schema import UspConfig
from usp.contract.decide import engine_choices, fault_tolerance_plan, hang_window
from usp.contract.dims import MESH_DIMS, ParallelDims
from usp.contract.run_plan import BatchPlan, Decisions, FaultTolerancePlan, ModelPlan, RunPlan
from usp.contract.typed import plain, rebuild
from usp.errors import PlanError
from usp.plan import rules
from usp.plan.pipeline_plan import plan_pipeline


def build_plan(cfg, choices: dict | None = None, cpu_count: int | None = None, *, force: bool = False,
               strict: bool = False, training: bool = True, derived: tuple | None = None) -> RunPlan:
    """Derive the run plan from a composed config (DictConfig or an object with the same fields);
    raise the first failing rule of kind "plan" (usp.plan.rules). force: a predicted OOM is a
    warning, not an error. strict: a TP group across nodes is an error. training=False (`usp plan`,
    `usp estimate`): limits of the data pipeline are warnings. derived: what `_subject` returned for
    this config, when the caller has it already."""
    from usp.plan.validate import analyse, check_run

    cluster, train, model = cfg.cluster, cfg.train, cfg.model
    subject, degrees, batch = derived or _subject(cfg)
    error = rules.first_failure(subject, ("plan",))
    if error is not None:
        raise error
    arch = subject.arch
    per_token = float(arch.flops_per_token(batch.seq_len))
    pipeline = plan_pipeline(cfg.parallelism, arch, degrees, batch.grad_accum)
    nodes, per_node = int(cluster.nodes), int(cluster.procs_per_node)
    dims = ParallelDims.of(degrees, int(cfg.parallelism.ep))
    name = f"{model.name}-{dims.label(with_ep=False)}" if train.name is None else str(train.name)  # "" is refused
    check_run(cfg, name)
    config = typed_config(cfg)
    if config.model.init_from:  # the ranks may start in another directory (Slurm): absolute
        config.model.init_from = str(Path(config.model.init_from).expanduser().resolve())
    if str(config.checkpoint.resume) not in ("auto", "never"):  # the same for a checkpoint path
        config.checkpoint.resume = str(Path(config.checkpoint.resume).expanduser().resolve())
    run_dir = str(Path(train.runs_dir).expanduser().resolve() / name)
    data_warnings: list[str] = []
    plan = RunPlan(
        name=name, run_dir=run_dir, world_size=nodes * per_node,
        nodes=nodes, procs_per_node=per_node, device=cluster.device, backend=_backend(cluster),
        threads_per_proc=_threads_per_proc(cluster, per_node, cpu_count),
        degrees=degrees, mesh_dims=list(MESH_DIMS), mesh_shape=dims.mesh_shape,
        batch=batch, model=ModelPlan(model.name, arch.total_params, arch.vocab_size, per_token,
                                     per_token * batch.global_batch_tokens),
        dataset_dir=_planned_dataset_dir(cfg.data, data_warnings),
        choices=dict(choices or {}), config=config,
        decisions=decisions(config, degrees, str(cluster.device), run_dir, arch.vocab_size),
        pipeline=pipeline, warnings=data_warnings + _unused_rows(cfg, int(cfg.model.vocab_size)) + _skipped_mtp(cfg),
    )
    ft = fault_tolerance_plan(config, degrees, nodes, per_node)
    plan.fault_tolerance = FaultTolerancePlan(**ft) if ft is not None else None
    analyse(plan, cfg, subject, force=force, strict=strict, training=training)
    _watch_for_hangs(plan)
    return plan


def _watch_for_hangs(plan: RunPlan) -> None:
    """plan.decisions.hang from the predicted step time (attached by analyse): when a rank counts as hung."""
    # a checkpoint's bytes as usp/launch/checkpoints.py counts them: fp32 weights + AdamW's two moments
    checkpoint_bytes = plan.model.params * 12.0
    step_s = plan.timing.step_s if plan.timing is not None else None
    plan.decisions.hang, warning = hang_window(plan.config, plan.world_size, step_s, checkpoint_bytes)
    if warning is not None:
        plan.warnings.append(warning)


def typed_config(cfg) -> UspConfig:
    """The resolved config as the schema's dataclasses (a composed DictConfig, a UspConfig, or the plain
    values of one)."""
    if OmegaConf.is_config(cfg):
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]
    return rebuild(UspConfig, plain(cfg))


def decisions(config: UspConfig, degrees: dict[str, int], device: str, run_dir: str, vocab: int) -> Decisions:
    """What the engine does with this config on this layout and device (usp/contract/decide.py's rules)."""
    return Decisions(**engine_choices(config, degrees, device, vocab, run_dir))


def _subject(cfg) -> tuple[rules.Subject, dict, BatchPlan]:
    """The checks the rule subject needs first (every field rule, the degrees, the batch, the
    tokenizer's vocabulary), then the subject, the degrees and the batch."""
    from usp.plan.planner_inputs import config_field_failures

    found = config_field_failures(cfg)
    if found:
        raise found[0]
    return _derive(cfg)


def _derive(cfg) -> tuple[rules.Subject, dict, BatchPlan]:
    """The degrees, the batch and the tokenizer's vocabulary checked, then the rule subject; the
    field rules passed."""
    from usp.plan.planner_inputs import rule_subject
    from usp.plan.validate import derive_batch

    cluster = cfg.cluster
    degrees = ParallelDims.resolve(cfg.parallelism, int(cluster.nodes) * int(cluster.procs_per_node)).mesh
    batch = derive_batch(cfg.train, degrees)
    model_vocab = int(cfg.model.vocab_size)
    token_vocab = _tokenizer_vocab_here(cfg.data, model_vocab)
    if 0 < model_vocab < token_vocab:  # every token id needs an embedding row
        if getattr(cfg.model, "init_from", None):
            raise PlanError(f"the tokenizer's {token_vocab:,} ids don't fit the checkpoint's embedding of "
                            f"{model_vocab:,} rows (its config.json's vocab_size)", key="data.tokenizer",
                            value=cfg.data.tokenizer, fix="the checkpoint's own tokenizer: data.tokenizer=hf "
                            f"data.tokenizer_path={cfg.model.init_from}")
        raise PlanError(f"the tokenizer's {token_vocab:,} ids don't fit the model's embedding", key="model.vocab_size",
                        value=model_vocab, fix=f"model.vocab_size=-1 (take it from the tokenizer) or >= {token_vocab}")
    vocab = model_vocab if model_vocab > 0 else token_vocab  # as data_vocab, without reading the tokenizer again
    init_from = getattr(cfg.model, "init_from", None)
    if init_from:  # a Hugging Face checkpoint to start from: its config.json must be this model group
        from usp.plan.hf_config import check_hf_config, read_hf_config
        from usp.plan.hf_files import check_hf_files

        check_hf_config(read_hf_config(init_from), cfg.model, vocab, str(init_from))
        check_hf_files(init_from)
    return rule_subject(cfg, degrees, batch, vocab), degrees, batch


def _skipped_mtp(cfg) -> list[str]:
    """A DeepSeek-V3 checkpoint's multi-token-prediction module, which a run without model.mtp_depth doesn't
    train: said, not refused (every DeepSeek-V3 config.json has one; transformers skips it too)."""
    if not getattr(cfg.model, "init_from", None) or int(getattr(cfg.model, "mtp_depth", 0) or 0):
        return []
    from usp.plan.hf_config import read_hf_config

    config = read_hf_config(cfg.model.init_from)
    depth = int(config.get("num_nextn_predict_layers") or 0) if config.get("model_type") == "deepseek_v3" else 0
    if not depth:
        return []
    first = int(config.get("num_hidden_layers") or 0)
    return [f"the checkpoint's multi-token-prediction module (num_nextn_predict_layers={depth}, "
            f"model.layers.{first}.*) is skipped: the run trains no MTP loss (model.mtp_depth=1 would), and "
            "`usp export --format hf` writes num_nextn_predict_layers: 0 (docs/models.md)"]


def _unused_rows(cfg, model_vocab: int) -> list[str]:
    """A checkpoint's embedding with more rows than the tokenizer has ids: legal (vocabularies are
    padded, Qwen's 151,936 rows for 151,669 ids), but worth a line when the tokenizer may be the wrong one."""
    if not getattr(cfg.model, "init_from", None):
        return []
    token_vocab = _tokenizer_vocab_here(cfg.data, model_vocab)
    if 0 < token_vocab < model_vocab:
        return [f"the checkpoint's embedding has {model_vocab:,} rows (config.json's vocab_size) and the tokenizer "
                f"{token_vocab:,} ids: rows from {token_vocab:,} on are never an input (padding, or the checkpoint's "
                f"own tokenizer is another: data.tokenizer=hf data.tokenizer_path={cfg.model.init_from})"]
    return []


def _tokenizer_vocab_here(data, model_vocab: int) -> int:
    """The tokenizer's vocabulary; 0 when its file is not on this machine and the model names its own
    vocabulary (a recipe planned on a laptop for a cluster: `usp prepare-data` and `usp train` read
    the tokenizer and check it where the run trains; the plan warns that the data was not checked)."""
    from usp.data.data_error import DataError
    from usp.plan.planner_inputs import tokenizer_vocab

    try:
        return tokenizer_vocab(data)
    except DataError:
        if model_vocab > 0:
            return 0
        raise


def _planned_dataset_dir(data, warnings: list[str]) -> str:
    """Where the tokenized data will be; "" when its source is not on this machine (the corpus
    package, the text files), with a warning: a plan made on a laptop for a cluster needs no data.
    `usp prepare-data` and `usp train` check the data where the run trains."""
    from usp.data.data_error import DataError
    from usp.data.tokenized import dataset_dir

    try:
        return str(dataset_dir(data))
    except DataError as exc:
        warnings.append(f"data not checked here: {exc} (`usp prepare-data` / `usp train` need it where the run "
                        "trains)")
        return ""


def _backend(cluster) -> str:
    if cluster.backend != "auto":
        return cluster.backend
    return {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl"}.get(cluster.device, "gloo")


def checked_plan(cfg, choices: dict | None = None) -> RunPlan:
    """The plan `usp train` runs: build_plan, and the first rule of kind "engine" that fails raised
    (a layout this engine can't train yet)."""
    plan = build_plan(cfg, choices)
    errors = engine_support_errors(plan)
    if errors:
        raise errors[0]
    return plan


def plan_with_failures(cfg, choices: dict | None = None, *, force: bool = False,
                       strict: bool = False) -> tuple[RunPlan | None, list[PlanError]]:
    """`usp plan`: the plan (None when it can't be built) and every failing rule, plan and engine
    kinds, in table order; when the plan fails for another reason (a degree, the batch, predicted
    OOM, --strict), that error comes first."""
    from usp.plan.planner_inputs import config_field_failures

    try:
        found = config_field_failures(cfg)
    except PlanError as exc:  # model.init_from's config.json
        return None, [exc]
    if found:  # the rest derives from these values: listed once they are fixed
        return None, found
    try:
        derived = _derive(cfg)
    except PlanError as exc:
        return None, [exc]
    found = rules.failures(derived[0])
    try:
        plan = build_plan(cfg, choices, force=force, strict=strict, training=False, derived=derived)
    except PlanError as exc:
        return None, found if any(str(e) == str(exc) for e in found) else [exc, *found]
    return plan, found


def _threads_per_proc(cluster, per_node: int, cpu_count: int | None) -> int:
    """cluster.threads_per_proc, else the node's CPUs split over its processes: on Slurm the nodes'
    (cluster.slurm.cpus_per_task; this login machine's count says nothing about them), else this one's,
    unless OMP_NUM_THREADS is set here (as every OpenMP program, and torchrun, honour it: e.g. several
    jobs sharing a machine, where a second thread per process only spins)."""
    if int(cluster.threads_per_proc):
        return _bounded_threads(cluster, int(cluster.threads_per_proc), cpu_count)
    if cluster.launcher != "slurm":
        omp = os.environ.get("OMP_NUM_THREADS", "")
        if omp.isdigit() and int(omp) > 0:
            return int(omp)
        return max(1, (cpu_count or os.cpu_count() or 1) // per_node)
    if not int(cluster.slurm.cpus_per_task):
        raise PlanError("a Slurm job needs the nodes' CPU count: cluster.slurm.cpus_per_task and "
                        "cluster.threads_per_proc are both 0", key="cluster.slurm.cpus_per_task", value=0,
                        fix=f"cluster.slurm.cpus_per_task=<CPUs per node> (split over {per_node} processes), "
                            "or cluster.threads_per_proc=<threads per process>")
    return max(1, int(cluster.slurm.cpus_per_task) // per_node)


# more threads than any node has CPUs (a Slurm node's count is unknown here without cpus_per_task)
MAX_THREADS_PER_NODE = 1024


def _bounded_threads(cluster, threads: int, cpu_count: int | None) -> int:
    """cluster.threads_per_proc, refused above the CPUs one process can use: this machine's for a
    local run, the job's cpus_per_task on Slurm (a run with 100,000 threads per process segfaults)."""
    if cluster.launcher != "slurm":
        cpus, where = cpu_count or os.cpu_count() or 1, "this machine has"
    elif int(cluster.slurm.cpus_per_task):
        cpus, where = int(cluster.slurm.cpus_per_task), "cluster.slurm.cpus_per_task gives a task"
    else:
        cpus, where = MAX_THREADS_PER_NODE, "no node has more than"
    if threads > cpus:
        raise PlanError(f"{threads} threads per process, but {where} {cpus} CPUs", key="cluster.threads_per_proc",
                        value=threads, fix=f"cluster.threads_per_proc=<1..{cpus}>, or 0 to split the CPUs over "
                                           "the processes")
    return threads


def engine_support_errors(plan: RunPlan) -> list[PlanError]:
    """The rules of kind "engine" (usp.plan.rules) this plan fails: layouts the engine cannot train
    (the plan may still describe them for estimates)."""
    from usp.plan.planner_inputs import rule_subject

    subject = rule_subject(plan.config, plan.degrees, plan.batch, plan.model.vocab_size)
    return rules.failures(subject, ("engine",))
