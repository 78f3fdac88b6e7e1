"""The training loop for sequence classification: length-grouped batches, bf16 autocast, grad accumulation.

Library code; the `train` stage (`python -m stages.train`) calls `train_classifier`, `evaluate` calls `predict`.
A plain loop rather than HF `Trainer`: it holds no padding, no per-step Python overhead we do not need, and it is
the place where resume, OOM back-off and telemetry hook in.
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import get_scheduler

from frugaltune.training.batching import collate, length_grouped_batches, sorted_batches


class DivergenceError(RuntimeError):
    """The loss became NaN or infinite; the message names the step."""


@dataclass(frozen=True)
class LoopConfig:
    lr: float
    head_lr: float | None = None
    weight_decay: float = 0.0
    scheduler: str = "linear"
    warmup_ratio: float = 0.05
    epochs: float = 1.0
    max_steps: int | None = None
    batch_size: int = 16
    grad_accum: int = 1
    max_grad_norm: float = 1.0
    bf16: bool = False
    group_by_length: bool = True
    log_every: int = 10
    seed: int = 42
    head_names: tuple[str, ...] = ("score",)


@dataclass
class TrainResult:
    steps: int
    micro_batches: int
    sequences: int
    tokens: int  # useful (non-pad) tokens
    padded_tokens: int  # tokens the model computed, padding included
    wall_seconds: float
    final_loss: float  # mean loss over the last logging window
    mean_loss: float
    peak_rss_mb: float
    history: list[dict] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.wall_seconds if self.wall_seconds else 0.0


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def autocast(bf16: bool, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def _param_groups(model: torch.nn.Module, cfg: LoopConfig) -> list[dict]:
    head, body = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (head if any(h in name for h in cfg.head_names) else body).append(param)
    groups = [{"params": body, "lr": cfg.lr}] if body else []
    if head:
        groups.append({"params": head, "lr": cfg.head_lr or cfg.lr})
    return groups


def plan_steps(num_examples: int, cfg: LoopConfig) -> int:
    micro_per_epoch = math.ceil(num_examples / cfg.batch_size)
    steps_per_epoch = math.ceil(micro_per_epoch / cfg.grad_accum)
    return cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))


def train_classifier(
    model: torch.nn.Module,
    input_ids: list[list[int]],
    labels: list[int],
    cfg: LoopConfig,
    pad_token_id: int,
    on_log: Callable[[dict], None] | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train `model` (already wrapped by its method) on tokenized examples; return counts, losses and timings."""
    device = next(model.parameters()).device
    lengths = [len(ids) for ids in input_ids]
    total_steps = plan_steps(len(input_ids), cfg)
    optimizer = torch.optim.AdamW(_param_groups(model, cfg), weight_decay=cfg.weight_decay)
    scheduler = get_scheduler(cfg.scheduler, optimizer, num_warmup_steps=int(cfg.warmup_ratio * total_steps),
                              num_training_steps=total_steps)
    generator = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # dropout

    def micro_batches():
        while True:  # epochs, each with its own seeded order
            yield from length_grouped_batches(lengths, cfg.batch_size, generator, cfg.group_by_length)

    batches = micro_batches()
    model.train()
    history: list[dict] = []
    losses: list[float] = []
    window: list[float] = []
    tokens = padded = sequences = micros = 0
    window_tokens, window_start = 0, time.perf_counter()
    start = time.perf_counter()
    bar = tqdm(total=total_steps, desc="train", unit="step", disable=not progress, dynamic_ncols=True)
    for step in range(1, total_steps + 1):
        step_loss = 0.0
        for _ in range(cfg.grad_accum):
            batch_index = next(batches)
            batch = collate([input_ids[i] for i in batch_index], pad_token_id)
            batch = {k: v.to(device) for k, v in batch.items()}
            target = torch.tensor([labels[i] for i in batch_index], device=device)
            with autocast(cfg.bf16, device):
                loss = model(**batch, labels=target).loss
            (loss / cfg.grad_accum).backward()
            step_loss += loss.item() / cfg.grad_accum
            useful = sum(lengths[i] for i in batch_index)
            tokens += useful
            window_tokens += useful
            padded += batch["input_ids"].numel()
            sequences += len(batch_index)
            micros += 1
        if not math.isfinite(step_loss):
            raise DivergenceError(f"loss is {step_loss} at step {step}: training diverged. Lower train.lr "
                                  f"(now {cfg.lr}) or use train.precision: fp32.")
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)
        window.append(step_loss)
        bar.update(1)
        if step % cfg.log_every == 0 or step == total_steps:
            now = time.perf_counter()
            record = {
                "step": step,
                "loss": float(np.mean(window)),
                "lr": scheduler.get_last_lr()[0],
                "tokens_per_s": window_tokens / max(now - window_start, 1e-9),
                "elapsed_s": now - start,
            }
            history.append(record)
            bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
            if on_log:
                on_log(record)
            last_window, window, window_tokens, window_start = window, [], 0, now
    bar.close()
    return TrainResult(
        steps=total_steps,
        micro_batches=micros,
        sequences=sequences,
        tokens=tokens,
        padded_tokens=padded,
        wall_seconds=time.perf_counter() - start,
        final_loss=float(np.mean(last_window)),
        mean_loss=float(np.mean(losses)),
        peak_rss_mb=peak_rss_mb(),
        history=history,
    )


@torch.no_grad()
def predict(model: torch.nn.Module, input_ids: list[list[int]], pad_token_id: int, batch_size: int = 32,
            bf16: bool = False, progress: bool = True) -> np.ndarray:
    """Class ids for every example, in input order."""
    device = next(model.parameters()).device
    model.eval()
    predictions = np.zeros(len(input_ids), dtype=np.int64)
    batches = sorted_batches([len(ids) for ids in input_ids], batch_size)
    for batch_index in tqdm(batches, desc="predict", disable=not progress, dynamic_ncols=True):
        batch = {k: v.to(device) for k, v in collate([input_ids[i] for i in batch_index], pad_token_id).items()}
        with autocast(bf16, device):
            logits = model(**batch).logits
        predictions[batch_index] = logits.float().argmax(-1).cpu().numpy()
    return predictions
