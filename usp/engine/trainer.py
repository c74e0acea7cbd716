"""The training loop: micro batches with gradient accumulation (no gradient sync on inner
micro batches), or a pipeline schedule; clipping, AdamW + schedule, periodic validation,
metrics, final summary. The parallel wrappers come from usp/engine/model_setup.py."""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from usp.data.sampler import BatchSampler, EvalBatches, TokenFile, get_batch
from usp.engine.console import Console, rank_logger
from usp.engine.dist import DistContext, all_reduce_mean
from usp.engine.grad_norm import clip_grad_norm
from usp.engine.metrics import MetricsWriter
from usp.engine.model_setup import build_model
from usp.engine.optim import build_optimizer, build_scheduler
from usp.engine.parallel.data import gradient_sync


class Trainer:
    def __init__(self, plan: dict, ctx: DistContext, write_outputs: bool = True):
        self.plan, self.ctx = plan, ctx
        self.cfg = OmegaConf.create(plan["config"])
        self.run_dir = Path(plan["run_dir"])
        self.log = rank_logger(self.run_dir, ctx.rank)
        train, batch = self.cfg.train, plan["batch"]
        self.steps, self.seq_len = int(train.steps), int(batch["seq_len"])
        self.micro, self.accum = int(batch["micro_batch"]), int(batch["grad_accum"])
        self.global_tokens = int(batch["global_batch"]) * self.seq_len
        self.autocast = _autocast(train.dtype, ctx.device)
        deg = ctx.degrees
        self.cp, self.cp_rank = deg["cp"], ctx.coords["cp"]
        self.loss_parallel = deg["tp"] > 1

        dataset, self.meta = Path(plan["dataset_dir"]), plan["data_meta"]
        self.train_tokens = TokenFile(dataset / self.meta["train_bin"])  # absolute for token_files
        self.val_tokens = TokenFile(dataset / self.meta["val_bin"])
        self.sampler = BatchSampler(len(self.train_tokens), self.seq_len, int(batch["global_batch"]), self.micro,
                                    ctx.dp_rank, ctx.dp_size, int(train.seed))
        # Validation uses global-batch-sized batches so every layout evaluates the same sequences.
        self.eval_batches = EvalBatches(len(self.val_tokens), self.seq_len, int(batch["global_batch"]),
                                        int(train.eval_batches), ctx.dp_rank, ctx.dp_size)

        self.parts = build_model(plan, ctx)
        self.raw_model = self.parts.raw
        params = list(self.parts.parameters())
        self.optimizer = build_optimizer(params, self.cfg.optimizer, ctx.device,
                                         zero1_group=ctx.group("dp_replicate") if self.cfg.parallelism.zero1 else None)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.optimizer, self.steps)
        self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl") if ctx.is_main and write_outputs else None
        self.console = Console(self.cfg.logging.console, self.steps, enabled=ctx.is_main)

    # -- one optimizer step ------------------------------------------------------------
    def train_step(self, step: int) -> tuple[float, float]:
        for m in self.parts.modules:
            m.train()
        if self.parts.schedule is not None:
            loss = self._pipeline_step(step)
        else:
            loss = self._accumulate(step)
        if int(self.cfg.parallelism.ep) > 1:
            from usp.engine.parallel.expert import reduce_gradients

            ep_group, edp_group = self.ctx.expert_groups(int(self.cfg.parallelism.ep), self.plan["ranks"])
            reduce_gradients(self.parts.modules[0], self.ctx.group("dp_replicate"), ep_group, edp_group)
        clip = float(self.cfg.optimizer.grad_clip)
        grad_norm = clip_grad_norm(list(self.parts.parameters()), clip, self.ctx.group("pp"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return all_reduce_mean(loss, self.ctx), grad_norm

    def _accumulate(self, step: int) -> float:
        model, total = self.parts.modules[0], 0.0
        micro_batches = self.sampler.micro_batches(step)
        for i, starts in enumerate(micro_batches):
            x, y, positions = self._batch(self.train_tokens, starts)
            # all-reduce / reduce-scatter gradients only after the last micro batch of the step
            with gradient_sync(model, i == len(micro_batches) - 1), self._loss_context():
                with self.autocast:
                    loss = self._loss(model(x, positions), y)
                (loss / self.accum + self._aux_loss()).backward()
            total += _item(loss)
        return total / len(micro_batches)

    def _pipeline_step(self, step: int) -> float:
        from usp.engine.pipeline_setup import pipeline_step

        starts = [s for mb in self.sampler.micro_batches(step) for s in mb]  # the rank's whole batch
        x, y, _ = self._batch(self.train_tokens, starts)
        with self._loss_context(), self.autocast:
            return pipeline_step(self.parts, self.ctx, x, y)

    @torch.no_grad()
    def evaluate(self) -> float:
        for m in self.parts.modules:
            m.eval()
        losses = []
        for rank_starts in self.eval_batches:
            if self.parts.schedule is not None:
                from usp.engine.pipeline_setup import pipeline_eval

                x, y, _ = self._batch(self.val_tokens, rank_starts)
                with self._loss_context(), self.autocast:
                    losses.append(pipeline_eval(self.parts, self.ctx, x, y))
                continue
            for first in range(0, len(rank_starts), self.micro):  # micro-batch sized forwards
                x, y, positions = self._batch(self.val_tokens, rank_starts[first:first + self.micro])
                with self._loss_context(), self.autocast:
                    losses.append(_item(self._loss(self.parts.modules[0](x, positions), y)))
        return all_reduce_mean(sum(losses) / max(1, len(losses)), self.ctx)

    # -- the loop ----------------------------------------------------------------------
    def fit(self) -> dict:
        ctx, train = self.ctx, self.cfg.train
        self.log.info("start: %d steps, %d tokens/step, world %d, device %s, layout %s", self.steps,
                      self.global_tokens, ctx.world_size, ctx.device, ctx.degrees)
        started = time.perf_counter()
        loss, val_loss, first_loss, self.history = float("nan"), None, None, []
        try:
            for step in range(self.steps):
                t0 = time.perf_counter()
                loss, grad_norm = self.train_step(step)
                dt = time.perf_counter() - t0
                first_loss = loss if first_loss is None else first_loss
                done = step + 1
                is_eval = done == self.steps or (train.eval_interval and done % train.eval_interval == 0)
                val_loss = self.evaluate() if is_eval else None
                record = None
                if is_eval or done == 1 or done % max(1, train.log_interval) == 0:
                    record = {"step": done, "loss": loss, "val_loss": val_loss,
                              "lr": self.scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                              "tokens": done * self.global_tokens, "step_time_s": dt,
                              "tokens_per_s": self.global_tokens / dt,
                              "tokens_per_s_per_device": self.global_tokens / dt / ctx.world_size,
                              "elapsed_s": time.perf_counter() - started}
                    self.history.append(record)
                    self.log.info("step %d loss %.6f val %s lr %.3e gnorm %.4f", done, loss, val_loss,
                                  record["lr"], grad_norm)
                    if self.metrics:
                        self.metrics.write(record)
                self.console.step(done, record)
        finally:
            self.console.close()
        elapsed = time.perf_counter() - started
        summary = {"steps": self.steps, "tokens": self.steps * self.global_tokens, "time_s": elapsed,
                   "tokens_per_s": self.steps * self.global_tokens / elapsed, "first_loss": first_loss,
                   "final_loss": loss, "final_val_loss": val_loss, "world_size": ctx.world_size}
        self.log.info("done: %s", json.dumps(summary))
        if self.metrics:
            self.metrics.close()
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    # -- helpers -----------------------------------------------------------------------
    def _batch(self, tokens: TokenFile, starts):
        """Inputs, targets and RoPE positions of this rank's tokens (its zigzag shard under CP)."""
        x, y = get_batch(tokens, starts, self.seq_len)
        x, y = torch.from_numpy(x).to(self.ctx.device), torch.from_numpy(y).to(self.ctx.device)
        if self.cp == 1:
            return x, y, None
        from usp.engine.parallel.context import zigzag_indices

        idx = zigzag_indices(self.seq_len, self.cp, self.cp_rank).to(self.ctx.device)
        return x[:, idx], y[:, idx], idx

    def _loss_context(self):
        if not self.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()  # cross entropy on vocab-sharded logits; must wrap backward too

    @staticmethod
    def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))

    def _aux_loss(self):
        """MoE load-balancing loss of the last forward (0 for dense models)."""
        coef = float(self.cfg.model.get("aux_loss_coef", 0.0))
        if int(self.cfg.model.get("n_experts", 0)) == 0 or coef == 0:
            return 0.0
        from usp.models.moe import moe_aux_loss

        return coef * moe_aux_loss(self.parts.modules[0]) / self.accum


def _item(loss) -> float:
    loss = loss.detach()
    return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)


def _autocast(dtype: str, device: torch.device):
    """fp32 on CPU; bf16 autocast on GPU (train.dtype=auto)."""
    use_bf16 = dtype == "bf16" or (dtype == "auto" and device.type != "cpu")
    if not use_bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
