"""Out of memory during a step: the loop halves every part of every batch from then on and runs the step again.

Library code, not run directly: `frugaltune.training.loop.train_classifier` catches the error (`is_oom`) and calls
`halve_micro_batch` (`batching` is its `LoopConfig.batching`). `FRUGALTUNE_TEST_OOM_AT_STEPS`
(`injected_oom_steps`) is the tests' way to cause one.
"""

from __future__ import annotations

import math
import os

import torch


class OutOfMemoryAtBatchOne(RuntimeError):
    """Out of memory with one sequence per micro-batch: nothing left to halve."""


def injected_oom_steps() -> set[int]:
    """Test hook: FRUGALTUNE_TEST_OOM_AT_STEPS=3,7 raises an out-of-memory error once at those steps."""
    raw = os.environ.get("FRUGALTUNE_TEST_OOM_AT_STEPS", "")
    return {int(s) for s in raw.split(",") if s.strip()}


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def halve_micro_batch(state: dict, batching, step: int, cause: BaseException | None, event) -> None:
    """Out of memory: every part of every batch from now on is half as wide (the effective batch is unchanged)."""
    size = math.ceil(batching.batch_size / state["micro_split"])
    if size <= 1:
        raise OutOfMemoryAtBatchOne(
            f"out of memory at step {step} with one sequence per micro-batch. Lower tokenize.max_length, use a "
            "lighter train.method (lora/qlora) or a machine with more memory.") from cause
    state["micro_split"] *= 2
    new_size = math.ceil(batching.batch_size / state["micro_split"])
    event(f"out of memory at step {step}: micro-batch {size} -> {new_size}, gradient accumulation "
          f"{batching.grad_accum * state['micro_split'] // 2} -> {batching.grad_accum * state['micro_split']} "
          f"(effective batch {batching.batch_size * batching.grad_accum} unchanged)")
