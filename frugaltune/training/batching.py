"""Training's length-grouped batches, their parts, and per-token targets; rows are padded by `frugaltune.classify.collate`
(each batch to its own longest row: no compute is spent on padding to a fixed length).

Library code used by `frugaltune.training.loop` and the plan; evaluation's batches are `frugaltune.classify`'s.
"""

from __future__ import annotations

import math
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


def epoch_batches(lengths: Sequence[int], batch_size: int, seed: int, epoch: int,
                  group_by_length: bool = True) -> list[list[int]]:
    """Epoch `epoch`'s batches of a run seeded `seed`: recomputable from the seed alone, so a resumed run needs only
    its position, and the plan knows every batch of the run before it starts."""
    generator = torch.Generator().manual_seed(seed * 1000 + epoch)
    return length_grouped_batches(lengths, batch_size, generator, group_by_length)


def run_batches(lengths: Sequence[int], batch_size: int, seed: int, count: int,
                group_by_length: bool = True) -> list[list[int]]:
    """The first `count` batches of the run, epoch after epoch, in the training loop's order."""
    batches: list[list[int]] = []
    epoch = 0
    while len(batches) < count and lengths:
        batches.extend(epoch_batches(lengths, batch_size, seed, epoch, group_by_length))
        epoch += 1
    return batches[:count]


def part_rows(rows: int, longest: int, micro_split: int, micro_batch_tokens: int | None) -> int:
    """Rows in each part of a micro-batch of `rows` sequences whose longest has `longest` tokens, as the training
    loop runs it: `micro_split` equal parts (the planned micro-batch, halved again after an out-of-memory error),
    and with `micro_batch_tokens` as few equal parts as keep each part's padded tokens under the cap (16 rows of
    65 tokens in 1,024 -> 8 + 8). The plan calls this too, so that the part it predicts is the part that runs."""
    chunk = max(1, math.ceil(rows / micro_split))
    if micro_batch_tokens and rows:
        cap = max(1, micro_batch_tokens // max(longest, 1))
        if chunk > cap:
            chunk = math.ceil(rows / math.ceil(rows / cap))
    return chunk


def parts(batch: Sequence[int], lengths: Sequence[int], micro_split: int,
          micro_batch_tokens: int | None) -> list[Sequence[int]]:
    """A micro-batch's examples in the parts the training loop runs them in (`part_rows` rows each, in order)."""
    chunk = part_rows(len(batch), max((lengths[i] for i in batch), default=0), micro_split, micro_batch_tokens)
    return [batch[c:c + chunk] for c in range(0, len(batch), chunk)]


IGNORE_INDEX = -100  # label of a token the loss skips (prompt and padding): transformers' convention


def collate_targets(targets: Sequence[int] | Sequence[Sequence[int]], width: int) -> torch.Tensor:
    """Class ids as they are; per-token targets (causal_lm) right-padded with IGNORE_INDEX to `width`."""
    if not targets or not isinstance(targets[0], Sequence):
        return torch.tensor(targets, dtype=torch.long)
    out = torch.full((len(targets), width), IGNORE_INDEX, dtype=torch.long)
    for row, seq in enumerate(targets):
        out[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


def target_counts(targets: Sequence[int] | Sequence[Sequence[int]]) -> list[int]:
    """What each example adds to the loss's mean: 1 for a class id; for per-token targets the tokens the causal LM
    loss counts (not IGNORE_INDEX, and not the first: the loss predicts token t from the tokens before it)."""
    if not targets or not isinstance(targets[0], Sequence):
        return [1] * len(targets)
    return [sum(1 for t in seq[1:] if t != IGNORE_INDEX) for seq in targets]
