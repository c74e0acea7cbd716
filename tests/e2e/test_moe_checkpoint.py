"""Expert-parallel checkpoints for real (docs/moe.md): the experts are saved as whole
(n_experts, ...) tensors, so a run saved under ep 2 continues under ep 4, on one process, under
ep 2 x tp 2 (and saves there the same tensors), or after a kill -9 with the uninterrupted run's
losses; a pipelined EP run with aux-loss-free
balancing on as well continues without the pipeline (its router biases in the checkpoint); and a
Mixtral-shaped tiny model (untied head, grouped-query attention) trained under ep2 x dp_shard2
exports to a MixtralForCausalLM with usp's logits. The default moe_tiny: load-balancing loss on."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.test_checkpoint import assert_same, kill_rank1_and_restart, spawn, train, train_here
from tests.helpers import losses, usp_cli
from usp.contract.plan_file import read_plan

# Each test trains 2 to 4 runs of 2 or 4 processes: the first (with the module's ep2 run) took 152 s,
# the file ~6 min, on the shared 2-core machine at load average ~12 (measured).
pytestmark = pytest.mark.timeout(900)

STEPS = 12  # resumed layouts continue 4 steps: further on, a near-tie in the top-k routing may flip (see docs/moe.md)
EP2 = ["model=moe_tiny", f"train.steps={STEPS}", "checkpoint.interval=4", "checkpoint.keep_last=0",
       "train.global_batch=8",
       "cluster.procs_per_node=2", "parallelism.dp_shard=2", "parallelism.dp_replicate=1", "parallelism.ep=2"]
TOL = 1e-5


def _same(a: dict, b: dict, steps) -> None:
    assert_same(a, b, steps, TOL)
    print("max relative loss difference", max(abs(a[s] - b[s]) / abs(a[s]) for s in steps))


def _step(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def _ckpt_keys(ckpt: Path) -> dict:
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory, shakespeare) -> Path:
    """12 steps under ep 2 x dp_shard 2, a checkpoint every 4, saved asynchronously as the Mixtral
    recipe saves them (the tests below resume from these)."""
    runs = tmp_path_factory.mktemp("ep2")
    train(runs, *EP2, "checkpoint.async_mode=async", "train.name=ep2")
    return runs / "ep2"


@pytest.mark.distributed
def test_ep_checkpoint_holds_whole_experts_and_resumes_under_ep4_one_process_and_tp(tmp_path, ep2_run):
    meta = _ckpt_keys(_step(ep2_run, 8))
    for key in ("model.layers.0.feed_forward.experts.w1", "optim.state.layers.1.feed_forward.experts.w2.exp_avg_sq"):
        assert tuple(meta[key].size)[0] == 4 and len(meta[key].chunks) == 2, key  # 4 experts, one chunk per EP rank
    resume = f"checkpoint.resume={_step(ep2_run, 8)}"
    ep4 = [*EP2[:5], "cluster.procs_per_node=4", "parallelism.dp_shard=4", "parallelism.dp_replicate=1",
           "parallelism.ep=4"]
    proc = train(tmp_path, *ep4, "train.name=ep4", resume)
    assert "saved under dp_shard=2, now dp_shard=4" in proc.stdout
    train_here(tmp_path, *EP2[:5], "train.name=one_process", resume)
    train(tmp_path, *EP2, "cluster.procs_per_node=4", "parallelism.tp=2", "train.name=ep2_tp2", resume)
    for name in ("ep4", "one_process", "ep2_tp2"):
        assert sorted(losses(tmp_path / name)) == list(range(9, STEPS + 1))
        _same(losses(ep2_run), losses(tmp_path / name), range(9, STEPS + 1))
    # saved under tp 2 (the experts replicated over tp): the same whole tensors as the ep2 run's
    ours, tp2 = _model_tensors(_step(ep2_run, STEPS)), _model_tensors(_step(tmp_path / "ep2_tp2", STEPS))
    assert ours.keys() == tp2.keys()
    worst = max(float((ours[k] - tp2[k]).abs().max()) for k in ours)
    print("max |parameter difference| after resuming under tp 2", worst)
    assert worst < 1e-4


@pytest.mark.distributed
def test_kill9_of_an_ep_rank_restarts_and_resumes_exactly(tmp_path, ep2_run):
    proc = spawn(tmp_path, *EP2, "train.max_restarts=1", "train.name=killed")
    run_dir = tmp_path / "killed"
    assert kill_rank1_and_restart(run_dir, proc, after_step=6)["resumed_from_step"] >= 4
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    _same(losses(ep2_run), losses(run_dir), range(1, STEPS + 1))


@pytest.mark.distributed
def test_pipelined_ep_with_router_bias_resumes_without_the_pipeline(tmp_path, shakespeare):
    """pp 2 x ep 2 x dp_shard 2 (4 processes), the default load-balancing loss and aux-loss-free
    balancing both on: saved at step 4, continued by ep 2 x dp_shard 2 alone (the same
    micro-batch steps, so the same balancing statistics); the biases travel in the checkpoint
    and end where the pipelined run's do."""
    common = ["model=moe_tiny", "model.n_layers=4", "model.tie_embeddings=false",
              "model.router_bias_update_rate=0.001", "train.steps=8", "checkpoint.interval=4",
              "train.global_batch=8", "train.micro_batch=2", "parallelism.dp_shard=2", "parallelism.dp_replicate=1",
              "parallelism.ep=2"]
    train(tmp_path, *common, "cluster.procs_per_node=4", "parallelism.pp=2", "train.name=pp2")
    bias = "model.layers.3.feed_forward.expert_bias"
    assert bias in _ckpt_keys(_step(tmp_path / "pp2", 4))
    train(tmp_path, *common, "cluster.procs_per_node=2", "train.name=pp1",
          f"checkpoint.resume={_step(tmp_path / 'pp2', 4)}")
    _same(losses(tmp_path / "pp2"), losses(tmp_path / "pp1"), range(5, 9))
    ends = [_model_tensors(_step(tmp_path / run, 8))[bias.removeprefix("model.")] for run in ("pp2", "pp1")]
    assert ends[0].abs().max() > 0 and torch.equal(ends[0], ends[1])


# Mixtral's shape at a tiny size: an untied LM head, grouped-query attention, Mixtral's RoPE base
MIXTRAL_TINY = ["model=moe_tiny", "model.tie_embeddings=false", "model.n_kv_heads=2", "model.rope_theta=1e6"]


@pytest.mark.distributed
def test_ep_run_exports_to_mixtral_with_usp_logits(tmp_path, shakespeare):
    from transformers import AutoModelForCausalLM

    from usp.models.llama import Llama, LlamaArgs

    train(tmp_path, *MIXTRAL_TINY, "train.steps=4", "checkpoint.interval=4", "train.global_batch=8",
          "cluster.procs_per_node=2", "parallelism.dp_shard=2", "parallelism.dp_replicate=1", "parallelism.ep=2",
          "train.name=mixtral")
    run_dir, out = tmp_path / "mixtral", tmp_path / "hf"
    proc = usp_cli("export", str(run_dir), "--format", "hf", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == "MixtralForCausalLM"
    assert (hf.config.num_local_experts, hf.config.num_key_value_heads, hf.config.tie_word_embeddings) == (4, 2, False)
    plan = read_plan(run_dir / "plan.yaml")
    args = LlamaArgs.from_config(plan.config.model, int(plan.model.vocab_size))
    model = Llama(args, max_seq_len=64)
    model.load_state_dict(_model_tensors(_step(run_dir, 4)))
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    print("max |logits difference|", float((ours - theirs).abs().max()))
    assert torch.allclose(ours, theirs, rtol=0, atol=TOL), (ours - theirs).abs().max()


def _model_tensors(ckpt: Path) -> dict:
    from usp.engine.export import load_model_state

    return load_model_state(ckpt)
