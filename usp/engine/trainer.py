"""The training loop: micro batches with gradient accumulation (no gradient sync on inner
micro batches), clipping, AdamW + schedule, periodic validation, metrics, final summary."""
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
from usp.engine.metrics import MetricsWriter
from usp.engine.model_setup import build_model
from usp.engine.optim import build_optimizer, build_scheduler


class Trainer:
    def __init__(self, plan: dict, ctx: DistContext):
        self.plan, self.ctx = plan, ctx
        self.cfg = OmegaConf.create(plan["config"])
        self.run_dir = Path(plan["run_dir"])
        self.log = rank_logger(self.run_dir, ctx.rank)
        train, batch = self.cfg.train, plan["batch"]
        self.steps, self.seq_len = int(train.steps), int(batch["seq_len"])
        self.micro, self.accum = int(batch["micro_batch"]), int(batch["grad_accum"])
        self.global_tokens = int(batch["global_batch"]) * self.seq_len
        self.autocast = _autocast(train.dtype, ctx.device)

        dataset, self.meta = Path(plan["dataset_dir"]), plan["data_meta"]
        self.train_tokens = TokenFile(dataset / self.meta["train_bin"])  # absolute for token_files
        self.val_tokens = TokenFile(dataset / self.meta["val_bin"])
        self.sampler = BatchSampler(len(self.train_tokens), self.seq_len, int(batch["global_batch"]), self.micro,
                                    ctx.dp_rank, ctx.dp_size, int(train.seed))
        # Validation uses global-batch-sized batches so every layout evaluates the same sequences.
        self.eval_batches = EvalBatches(len(self.val_tokens), self.seq_len, int(batch["global_batch"]),
                                        int(train.eval_batches), ctx.dp_rank, ctx.dp_size)

        self.model, self.raw_model = build_model(plan, ctx)
        self.optimizer = build_optimizer(self.model, self.cfg.optimizer, ctx.device)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.optimizer, self.steps)
        self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl") if ctx.is_main else None
        self.console = Console(self.cfg.logging.console, self.steps, enabled=ctx.is_main)

    # -- one optimizer step ------------------------------------------------------------
    def train_step(self, step: int) -> tuple[float, float]:
        self.model.train()
        total = 0.0
        micro_batches = self.sampler.micro_batches(step)
        for i, starts in enumerate(micro_batches):
            x, y = self._tensors(self.train_tokens, starts)
            last = i == len(micro_batches) - 1
            # DDP: all-reduce gradients only after the last micro batch of the step.
            sync = contextlib.nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()
            with sync:
                with self.autocast:
                    loss = self._loss(self.model(x), y)
                (loss / self.accum).backward()
            total += loss.detach().item()
        clip = float(self.cfg.optimizer.grad_clip)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return all_reduce_mean(total / len(micro_batches), self.ctx), float(grad_norm)

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        losses = []
        for rank_starts in self.eval_batches:
            for first in range(0, len(rank_starts), self.micro):  # micro-batch sized forwards
                x, y = self._tensors(self.val_tokens, rank_starts[first:first + self.micro])
                with self.autocast:
                    losses.append(self._loss(self.model(x), y).item())
        return all_reduce_mean(sum(losses) / max(1, len(losses)), self.ctx)

    # -- the loop ----------------------------------------------------------------------
    def fit(self) -> dict:
        ctx, train = self.ctx, self.cfg.train
        self.log.info("start: %d steps, %d tokens/step, world %d, device %s", self.steps, self.global_tokens,
                      ctx.world_size, ctx.device)
        started = time.perf_counter()
        loss, val_loss, first_loss = float("nan"), None, None
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
        if ctx.is_main:
            self.metrics.close()
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    # -- helpers -----------------------------------------------------------------------
    def _tensors(self, tokens: TokenFile, starts) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = get_batch(tokens, starts, self.seq_len)
        return torch.from_numpy(x).to(self.ctx.device), torch.from_numpy(y).to(self.ctx.device)

    @staticmethod
    def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def _autocast(dtype: str, device: torch.device):
    """fp32 on CPU; bf16 autocast on GPU (train.dtype=auto)."""
    use_bf16 = dtype == "bf16" or (dtype == "auto" and device.type != "cpu")
    if not use_bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
