"""The one classification evaluator: a sequence-classification model's scores on tokenized rows (`classify`), in
length-sorted, right-padded batches (`sorted_batches`, `collate`, which the training loop pads with too).

Library code, not run directly. The evaluate stage (`frugaltune.recipes.evaluate`), the federated clients and server
(`frugaltune.federated.local.evaluate`), batch serving (`frugaltune.serving.classifier`) and the plan's calibration
(`frugaltune.planner.measure`, which times it) all call `classify`, so a row is scored one way everywhere:

    scores = classify(model, input_ids, pad_token_id, batch_size=32, bf16=False, labels=None)
    scores.predictions      # class id per row, in input order
    scores.logits           # float32, rows x classes
    scores.loss             # mean cross-entropy per row, when `labels` are given

This module must import nothing from the rest of the project: `frugaltune.serving.pyfunc.log_model` pickles it by
value into the logged model, like serving itself, so a registered version loads without `frugaltune` installed.
torch is imported where used, as in `frugaltune.generation`, so importing serving does not load it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def sorted_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Deterministic inference batches, longest first (least padding, and an early OOM if any)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def collate(input_ids: Sequence[Sequence[int]], pad_token_id: int) -> dict[str, Any]:
    """Right-pad a batch to its own longest sequence: `input_ids` and `attention_mask` tensors."""
    import torch

    width = max(len(ids) for ids in input_ids)
    ids = torch.full((len(input_ids), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(input_ids), width), dtype=torch.long)
    for row, seq in enumerate(input_ids):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    return {"input_ids": ids, "attention_mask": mask}


@dataclass(frozen=True)
class Scores:
    """What `classify` gives: the float32 logits (rows x classes, input order) and, with labels, the mean loss."""

    logits: np.ndarray
    loss: float | None = None

    @property
    def predictions(self) -> np.ndarray:
        """Class id per row (the logits' argmax)."""
        return self.logits.argmax(-1)


def classify(model: Any, input_ids: Sequence[Sequence[int]], pad_token_id: int, batch_size: int = 32,
             bf16: bool = False, labels: Sequence[int] | None = None,
             progress: Callable[[Iterable], Iterable] | None = None) -> Scores:
    """The model's logits on every row, in input order, in `sorted_batches` padded by `collate`; under bf16 autocast
    with `bf16` (as the evaluate stage runs a model trained in bf16). `labels` (class id per row): also the mean
    cross-entropy per row, summed over batches in fp32 before the mean, so it does not depend on the batch size.
    `progress`: wraps the batches (a progress bar). Puts the model in eval mode."""
    import contextlib

    import torch

    device = next(model.parameters()).device
    model.eval()
    logits = np.zeros((len(input_ids), model.config.num_labels), dtype=np.float32)
    loss_sum = 0.0
    batches = sorted_batches([len(ids) for ids in input_ids], batch_size)
    # no_grad, not inference_mode: a federated client trains the same model next, and a tensor a module caches
    # during an inference_mode forward could not be saved for backward then
    with torch.no_grad():
        for batch in progress(batches) if progress else batches:
            inputs = {k: v.to(device) for k, v in collate([input_ids[i] for i in batch], pad_token_id).items()}
            with (torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()):
                out = model(**inputs).logits.float()
            if labels is not None:
                target = torch.tensor([labels[i] for i in batch], device=device)
                loss_sum += float(torch.nn.functional.cross_entropy(out, target, reduction="sum"))
            logits[batch] = out.cpu().numpy()
    return Scores(logits, None if labels is None else loss_sum / max(1, len(input_ids)))
