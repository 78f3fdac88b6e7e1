"""Fine-tuning methods: wrap a classification model so that only the method's parameters train.

Library code used by the `train` stage. Today: LoRA through peft (the classification head trains in full,
as peft's `modules_to_save`).
"""

from __future__ import annotations

import torch
from peft import LoraConfig, TaskType, get_peft_model


def apply_lora(model: torch.nn.Module, r: int, alpha: int, dropout: float, target_modules: list[str]) -> torch.nn.Module:
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [m for m in target_modules if m not in names]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"train.lora.target_modules: {missing} not found in the model. Its linear layers: {linear}.")
    config = LoraConfig(task_type=TaskType.SEQ_CLS, r=r, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=list(target_modules))
    return get_peft_model(model, config)
