"""The run's optimizer and learning-rate schedule: AdamW over the trainable weights in their rate groups.

Library code, not run directly: `frugaltune.training.loop.train_classifier` builds both before its first step
(`cfg` is its `LoopConfig`; the rate groups read its `optim` settings alone).
"""

from __future__ import annotations

import torch


def param_groups(model: torch.nn.Module, optim) -> list[dict]:
    head, body, lora_b = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if any(h in name for h in optim.head_names):
            head.append(param)
        elif optim.lora_plus_ratio != 1.0 and (".lora_B." in name or ".lora_embedding_B." in name):
            lora_b.append(param)
        else:
            body.append(param)
    groups = [{"params": body, "lr": optim.lr}] if body else []
    if lora_b:
        groups.append({"params": lora_b, "lr": optim.lr * optim.lora_plus_ratio})
    if head:
        groups.append({"params": head, "lr": optim.head_lr or optim.lr})
    return groups


def build_optimizer(model: torch.nn.Module, cfg, optimizer_state: dict | None) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(param_groups(model, cfg.optim), weight_decay=cfg.optim.weight_decay,
                                  fused=cfg.speed.fused_optimizer or None)  # None: torch's own choice (foreach on CUDA)
    if optimizer_state:
        restored = optimizer.state_dict()
        restored["state"] = optimizer_state
        optimizer.load_state_dict(restored)
    return optimizer


def build_scheduler(cfg, optimizer: torch.optim.Optimizer, total_steps: int):
    # imported here: transformers.optimization costs seconds at import, and evaluation only predicts
    from transformers import get_scheduler

    optim = cfg.optim
    return get_scheduler(optim.scheduler, optimizer, num_warmup_steps=int(optim.warmup_ratio * total_steps),
                         num_training_steps=total_steps)
