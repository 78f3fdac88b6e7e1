"""What a model computes on tokenized batches, in training and out: the loss of a batch (`model_loss`, reading a
shared prefix once: `shared_prefix_length`), the mean loss per response token (`lm_loss`), and the progress bar
evaluation draws (`bar`). Class scores are `frugaltune.classify`'s, the one classification evaluator.

Library code, not run directly: the training loop (`frugaltune.training.loop`) calls `model_loss` every step; the
`evaluate` stage (`frugaltune.recipes.evaluate`) calls `lm_loss`, and passes `bar` to `frugaltune.classify.classify`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from tqdm.auto import tqdm

from frugaltune import console
from frugaltune.classify import collate, sorted_batches
from frugaltune.training.batching import IGNORE_INDEX, collate_targets

# causal_lm: a batch whose rows start with at least this many equal tokens reads them once (LoopConfig's default)
SHARED_PREFIX_MIN = 8


def autocast(bf16: bool, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def shared_prefix_length(input_ids: torch.Tensor, target: torch.Tensor, min_length: int) -> int:
    """causal_lm: how many leading tokens every row of the batch has in common before the first one the loss reads
    a prediction from (a chat template's system turn, an instruction); 0 when fewer than `min_length`, one row, or
    class-id targets. `model_loss(..., shared=)` reads those tokens once for the whole batch."""
    if min_length <= 0 or target.dim() == 1 or input_ids.shape[0] < 2:
        return 0
    differs = (input_ids != input_ids[:1]).any(dim=0).nonzero()
    length = int(differs[0]) if len(differs) else input_ids.shape[1] - 1
    scored = (target[:, 1:] != IGNORE_INDEX).any(dim=0).nonzero()
    if len(scored):  # the logit at position t predicts token t + 1: the shared part ends before the first scored t
        length = min(length, int(scored[0]))
    return length if length >= min_length else 0


def model_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], target: torch.Tensor,
               reduction: str = "mean", shared: int = 0) -> torch.Tensor:
    """The training loss of one batch. Class ids (1-D target): the model's own (mean) loss. Per-token targets
    (causal_lm): cross-entropy over the tokens that count (`reduction` "mean" or "sum"), computing the LM head only
    where one is predicted.

    `shared` (causal_lm, from `shared_prefix_length`): the first `shared` tokens, equal in every row, run through
    the model once, as one row; their keys and values are repeated for the batch, whose rows continue from them.
    The gradient flows back through the repeat, so value and gradients are those of the whole batch (up to rounding;
    LoRA dropout draws one mask for the shared tokens instead of one per row). For prompt -> label-word SFT on
    the chat template, the shared system turn and instruction are about half of every row's tokens.

    transformers' `labels=` runs the LM head (hidden x vocab, 576 x 49,152 for SmolLM2) at every position and keeps
    a float logits tensor of tokens x vocab, although the loss reads only the response: for prompt -> label-word
    SFT that is 2-3 positions of ~90. `logits_to_keep` takes the positions whose next token is a target (their union
    over the batch: length-grouped rows end close together), so the head's matmul, its backward and the logits
    shrink by that ratio; the value is the same mean (or sum) over counted tokens as `labels=` gives.
    """
    if target.dim() == 1:
        return model(**batch, labels=target).loss
    following = target[:, 1:]  # the logit at position t predicts token t + 1
    positions = (following != IGNORE_INDEX).any(dim=0).nonzero().squeeze(1)
    if shared:
        ids = batch["input_ids"]
        nothing = torch.empty(0, dtype=torch.long, device=ids.device)  # no logits for the shared part
        cache = model(input_ids=ids[:1, :shared], use_cache=True, logits_to_keep=nothing).past_key_values
        cache.batch_repeat_interleave(ids.shape[0])
        logits = model(input_ids=ids[:, shared:], attention_mask=batch["attention_mask"], past_key_values=cache,
                       logits_to_keep=positions - shared).logits
    else:
        logits = model(**batch, logits_to_keep=positions).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             following[:, positions].reshape(-1), ignore_index=IGNORE_INDEX,
                                             reduction=reduction)


def bar(desc: str) -> Callable[[Iterable], Iterable]:
    """A progress bar over an evaluation's batches, drawn only where the project's loops draw one."""
    return lambda batches: tqdm(batches, desc=desc, disable=not console.progress_bars_on(), dynamic_ncols=True)


@torch.no_grad()
def lm_loss(model: torch.nn.Module, input_ids: list[list[int]], labels: list[list[int]], pad_token_id: int,
            batch_size: int = 32, bf16: bool = False, progress: bool = True) -> tuple[float, int]:
    """causal_lm: the mean cross-entropy per response token over all examples, and the number of those tokens.
    Summed per batch (not a mean of batch means), so the figure does not depend on the batch size."""
    device = next(model.parameters()).device
    model.eval()
    total, count = 0.0, 0
    batches = sorted_batches([len(ids) for ids in input_ids], batch_size)
    for batch_index in bar("loss")(batches) if progress else batches:
        batch = {k: v.to(device) for k, v in collate([input_ids[i] for i in batch_index], pad_token_id).items()}
        target = collate_targets([labels[i] for i in batch_index], batch["input_ids"].shape[1]).to(device)
        shared = shared_prefix_length(batch["input_ids"], target, SHARED_PREFIX_MIN)
        with autocast(bf16, device):
            total += model_loss(model, batch, target, reduction="sum", shared=shared).item()
        count += int((target[:, 1:] != IGNORE_INDEX).sum())
    return total / max(count, 1), count
