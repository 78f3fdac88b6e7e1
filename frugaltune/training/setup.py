"""How a training run is set up from params: the model, its int8 products, its rows and its LoopConfig.

Library code, no entry point. The train and compare stages and the planner's calibration (frugaltune/planner/)
build a run with these functions alone, so that the steps the plan times are the steps that train.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from frugaltune import paths

if TYPE_CHECKING:
    import torch

    from frugaltune.config import Params
    from frugaltune.methods import Method
    from frugaltune.training.distributed import World
    from frugaltune.training.loop_config import LoopConfig


def body_lr(params: "Params", method: "Method") -> float:
    """The learning rate of the trained body: `train.<method>.lr` for a method with its own (`Method.own_lr`: full,
    prelayer; null = `train.lr`), else `train.lr`."""
    tp = params.train
    return (getattr(tp, method.name).lr or tp.lr) if method.own_lr else tp.lr


def build_model(params: "Params", method: "Method", labels: list[str], pad_token_id: int, bf16: bool,
                gradient_checkpointing: bool = False, model_dir: Path | str = paths.BASE_MODEL) -> "torch.nn.Module":
    """The base model with a fresh head (seeded), prepared for `method` (`train.method`'s, as `resolve.Run` holds
    it) with its `train.<method>` knobs, as the train stage trains it."""
    from frugaltune.training.methods import prepare_model

    return prepare_model(model_dir, labels, pad_token_id, params.common.seed, method, params.train.knobs(method),
                         bf16, gradient_checkpointing, task=params.task.type)


def apply_int8(model: "torch.nn.Module", decision: dict, method: "Method", world: "World | None" = None) -> dict:
    """The plan's int8 decision carried out on `model` (frugaltune/int8.py). Every rank reads the same plan, so the
    ranks of one run compute the same products."""
    from frugaltune import int8

    if world is not None and world.distributed and world.sum([float(decision["on"])])[0] not in (0, world.size):
        decision = {**decision, "on": False, "why": decision["why"] + "; the ranks disagreed"}
    return int8.apply(model, decision, method)


def training_rows(params: "Params", input_ids: list[list[int]], tokenizer) -> list[list[int]]:
    """The training rows as the model sees them: classification rows wrapped in `train.input_template`."""
    from frugaltune.input_template import InputTemplate, wrapped

    tp = params.train
    template = (InputTemplate.build(tp.input_template, tokenizer)  # causal_lm: its prompts are its rows' own
                if tp.input_template is not None and params.task.type == "classification" else None)
    return wrapped(input_ids, template, params.tokenize.max_length)


def loop_config(params: "Params", *, method: "Method", bf16: bool, micro_batch_size: int | None,
                eager_attention_max_len: int, checkpoint_dir: Path | None = None, **overrides: Any) -> "LoopConfig":
    """The LoopConfig of `params.train` on the plan's decisions for `method` (frugaltune.resolve.Run), built by
    `LoopConfig.build`: the train and compare stages, the planner's calibration and the federated centralized
    reference (the train stage's recipe), so that what the plan times is what trains. `overrides`: settings (by
    their `LoopConfig.build` names) in place of what params gives."""
    from frugaltune.training.loop_config import LoopConfig

    tp = params.train
    settings = dict(
        checkpoint_dir=checkpoint_dir, checkpoint_every=tp.checkpoint_every, keep_checkpoints=tp.keep_checkpoints,
        resume=tp.resume == "auto", lr=body_lr(params, method), head_lr=tp.head_lr,
        lora_plus_ratio=tp.lora_plus_ratio, weight_decay=tp.weight_decay, scheduler=tp.scheduler,
        warmup_ratio=tp.warmup_ratio, epochs=tp.epochs, max_steps=tp.max_steps, batch_size=tp.batch_size,
        grad_accum=tp.grad_accum, max_grad_norm=tp.max_grad_norm, bf16=bf16, group_by_length=tp.group_by_length,
        log_every=tp.log_every, seed=params.common.seed, micro_batch_size=micro_batch_size,
        micro_batch_tokens=tp.micro_batch_tokens, eager_attention_max_len=eager_attention_max_len,
    )
    return LoopConfig.build(**(settings | overrides))
