"""Length-grouped batches with dynamic padding: no compute is spent on padding to a fixed length.

Library code used by `frugaltune.training.loop` and evaluation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def length_grouped_batches(
    lengths: Sequence[int], batch_size: int, generator: torch.Generator, group_by_length: bool = True,
    mega_batch_factor: int = 50,
) -> list[list[int]]:
    """One epoch of batches: shuffle, sort by length inside mega-batches, then shuffle the batch order.

    Sorting only inside mega-batches of `batch_size * mega_batch_factor` keeps the order random enough for SGD
    while batches hold sequences of similar length (the idea behind HF's `group_by_length`).
    """
    order = torch.randperm(len(lengths), generator=generator).tolist()
    if not group_by_length:
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    mega = batch_size * mega_batch_factor
    batches: list[list[int]] = []
    for start in range(0, len(order), mega):
        chunk = sorted(order[start:start + mega], key=lambda i: lengths[i], reverse=True)
        batches.extend(chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size))
    permutation = torch.randperm(len(batches), generator=generator).tolist()
    return [batches[i] for i in permutation]


def sorted_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Deterministic inference batches, longest first (least padding, and an early OOM if any)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def collate(input_ids: Sequence[Sequence[int]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch to its own longest sequence."""
    width = max(len(ids) for ids in input_ids)
    ids = torch.full((len(input_ids), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(input_ids), width), dtype=torch.long)
    for row, seq in enumerate(input_ids):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    return {"input_ids": ids, "attention_mask": mask}
