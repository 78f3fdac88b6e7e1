"""The training loop (sequence classification or causal LM): length-grouped batches, bf16 autocast, grad accumulation.

Library code; the `train` stage (`python -m stages.train`) calls `train_classifier`, `evaluate` calls `predict`.
A plain loop rather than HF `Trainer`: it holds no padding, no per-step Python overhead we do not need, and it is
the place where resume, OOM back-off and telemetry hook in.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from frugaltune import console, processes
from frugaltune.telemetry import StepTimer
from frugaltune.training import checkpoint
from frugaltune.training.batching import (IGNORE_INDEX, collate, collate_targets, epoch_batches, parts,
                                          sorted_batches, target_counts)
from frugaltune.training.distributed import World
from frugaltune.training.sharing import CoreShare
from frugaltune.training.fast import short_sequence_attention
from frugaltune.training.int8_lora import fused_int8_lora


class DivergenceError(RuntimeError):
    """The loss became NaN or infinite; the message names the step and the last good checkpoint."""


class TrainingInterrupted(RuntimeError):
    """SIGINT/SIGTERM arrived: a checkpoint was written and the run stopped; the message says how to resume."""


class OutOfMemoryAtBatchOne(RuntimeError):
    """Out of memory with one sequence per micro-batch: nothing left to halve."""


@dataclass(frozen=True)
class LoopConfig:
    lr: float
    head_lr: float | None = None
    # LoRA+ (Hayou et al. 2024): B's rate = ratio x lr; B starts at zero and its gradient is A-scaled, so at one
    # shared rate it moves too slowly for its role (peft's create_loraplus_optimizer does the same grouping)
    lora_plus_ratio: float = 1.0
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
    checkpoint_dir: Path | None = None  # None: no checkpoints
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    resume: bool = True
    micro_batch_size: int | None = None  # None = batch_size; smaller: each batch runs in parts (same gradient)
    # A part's padded tokens at most (rows x the batch's longest row): a wider batch runs in as few equal parts as
    # keep under it, accumulated like micro_batch_size's. None: no cap. Length-grouped batches are mostly short, so
    # this bounds the peak memory that the few long ones set, at the cost of splitting only those.
    micro_batch_tokens: int | None = None
    # Batches padded to at most this many tokens use eager attention, longer ones SDPA (0: SDPA always); the
    # crossover is measured by the kernels stage and resolved by the plan (frugaltune.training.fast)
    eager_attention_max_len: int = 0
    # causal_lm: a batch whose rows start with at least this many equal tokens reads them once (model_loss's
    # `shared`); 0: never. Off by itself under gradient checkpointing, which cannot carry a KV cache.
    shared_prefix_min: int = 8
    # AdamW as one fused kernel over every trainable tensor (torch's `fused=True`, CPU and CUDA) instead of the
    # per-tensor loop: LoRA has ~240 small tensors, so the loop is dispatch, not arithmetic. Same update to
    # rounding; measured faster on every machine tried (docs/DECISIONS.md, benchmarks/step_anatomy.py --ab optimizer)
    fused_optimizer: bool = True
    # LoRA layers over int8 frozen products run as one autograd node per product (q/k/v, gate/up, o, down): one
    # dropout, one cast, A's products stacked, B's added in addmm (frugaltune.training.int8_lora); a model without
    # int8 products has nothing it takes. Measured faster in paired steps (docs/DECISIONS.md,
    # benchmarks/step_anatomy.py --ab-paired 60 --ab int8lora)
    fused_int8_lora: bool = True
    # Where the output is not a terminal (a log file, a pipe), one progress line every this many seconds of wall
    # time (step/total, loss, tokens/s, ETA), flushed: a bar there is `\r` redraws, or nothing when bars are off
    progress_every_s: float = 30.0


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
    resumed_from_step: int = 0
    micro_batch_size: int = 0  # after any out-of-memory halving
    events: list[str] = field(default_factory=list)
    shared_prefix_tokens: int = 0  # token positions not computed: each batch's shared prefix x (its rows - 1)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.wall_seconds if self.wall_seconds else 0.0


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, or since `reset_peak_rss` (Linux's VmHWM, in KiB; elsewhere
    getrusage's lifetime peak)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> bool:
    """Start this process's peak RSS again from what it holds now (Linux: "5" written to /proc/self/clear_refs), so
    that a process running one job after another (a Simulation Engine worker: client after client) reports each
    job's own peak through `peak_rss_mb`. False where the kernel refuses: the peak is then the process's so far."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


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


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) as peft counts them: a 4-bit weight packs two values per byte and counts as both."""
    if hasattr(model, "get_nb_trainable_parameters"):  # a PeftModel
        trainable, total = model.get_nb_trainable_parameters()
        return int(trainable), int(total)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def _param_groups(model: torch.nn.Module, cfg: LoopConfig) -> list[dict]:
    head, body, lora_b = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if any(h in name for h in cfg.head_names):
            head.append(param)
        elif cfg.lora_plus_ratio != 1.0 and (".lora_B." in name or ".lora_embedding_B." in name):
            lora_b.append(param)
        else:
            body.append(param)
    groups = [{"params": body, "lr": cfg.lr}] if body else []
    if lora_b:
        groups.append({"params": lora_b, "lr": cfg.lr * cfg.lora_plus_ratio})
    if head:
        groups.append({"params": head, "lr": cfg.head_lr or cfg.lr})
    return groups


def plan_steps(num_examples: int, cfg: LoopConfig) -> int:
    micro_per_epoch = math.ceil(num_examples / cfg.batch_size)
    steps_per_epoch = math.ceil(micro_per_epoch / cfg.grad_accum)
    return cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))


class _EpochOrder:
    """Micro-batch `i` of the whole run, recomputable from the seed alone: resuming needs only the position."""

    def __init__(self, lengths: list[int], cfg: LoopConfig):
        self.lengths, self.cfg, self._epoch, self._batches = lengths, cfg, -1, []
        self.per_epoch = math.ceil(len(lengths) / cfg.batch_size)

    def __getitem__(self, position: int) -> list[int]:
        epoch, index = divmod(position, self.per_epoch)
        if epoch != self._epoch:
            self._batches = epoch_batches(self.lengths, self.cfg.batch_size, self.cfg.seed, epoch,
                                          self.cfg.group_by_length)
            self._epoch = epoch
        return self._batches[index]


def _injected_oom_steps() -> set[int]:
    """Test hook: FRUGALTUNE_TEST_OOM_AT_STEPS=3,7 raises an out-of-memory error once at those steps."""
    raw = os.environ.get("FRUGALTUNE_TEST_OOM_AT_STEPS", "")
    return {int(s) for s in raw.split(",") if s.strip()}


def _test_step_delay() -> float:
    """Test hook: FRUGALTUNE_TEST_STEP_DELAY_S slows each step so that a test can kill a run mid-way."""
    return float(os.environ.get("FRUGALTUNE_TEST_STEP_DELAY_S", "0") or 0)


def _test_sleep(seconds: float, stop: dict) -> None:
    """The test hook's delay, cut short by a stop signal: a stopped run then takes as long as a real one to end."""
    end = time.monotonic() + seconds
    while not stop and time.monotonic() < end:
        time.sleep(min(0.05, max(end - time.monotonic(), 0.0)))


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


@contextlib.contextmanager
def _stop_on_signals(flag: dict):
    """SIGINT/SIGTERM set a flag the loop checks after each step, so the checkpoint it writes is consistent."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}

    def handler(signum, _frame):
        flag["signal"] = signal.Signals(signum).name

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        # After a stop a stage is on its way out (checkpoint written, TrainingInterrupted raised): the parent-death
        # SIGTERM (frugaltune/processes.py) that follows a process group's once DVC has died must not cut its exit
        # short (its message, its MLflow run marked KILLED). There the flag handler stays: it does nothing more.
        if not (flag and processes.dies_with_parent()):
            for sig, old in previous.items():
                signal.signal(sig, old)


def _unpack_4bit_inference_layout(model: torch.nn.Module) -> None:
    """Give 4-bit weights back their trainable layout.

    On CPUs with avx512_bf16, bitsandbytes repacks a 4-bit weight in place the first time its layer runs in eval
    mode without gradients (an evaluation), into a layout only its inference kernel reads, and keeps it. A QLoRA
    model evaluated before training (a federated client scoring the global adapter, a test's loss before) then
    trained through that kernel: its loss did not fall. bitsandbytes undoes the packing itself only when saving or
    moving the weight to a GPU; this is the same conversion, before the first step.
    """
    for module in model.modules():
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is not None and getattr(state, "packing_format_for_cpu", False):
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
            if hasattr(module, "quant_state"):  # the module's copy, which bitsandbytes falls back on
                module.quant_state = weight.quant_state


@dataclass
class _StepSums:
    """What one optimizer step computed, summed over its micro-batches and their parts."""

    loss: float = 0.0
    tokens: int = 0  # useful (non-pad) tokens
    padded: int = 0
    sequences: int = 0
    shared: int = 0  # token positions not computed: each part's shared prefix x (its rows - 1)
    micros: int = 0  # forward/backward passes (parts)


@dataclass
class _Data:
    """The run's examples as the loop reads them."""

    input_ids: list[list[int]]
    labels: list
    lengths: list[int]
    counts: list[int]  # what each example adds to its batch's mean loss (target_counts)
    pad_token_id: int


def _accumulate(model: torch.nn.Module, data: _Data, batch_index: list[int], mine: list[int], cfg: LoopConfig,
                micro_split: int, share_from: int, phase, sums: _StepSums, inject_oom: bool) -> None:
    """Forward and backward of this rank's share (`mine`) of one micro-batch, in the parts the loop splits it into
    (`part_rows`: `micro_split` after out-of-memory halvings, and the token cap); gradients accumulate, each part
    weighted by what it adds to the whole batch's mean loss, so splits and ranks add up to the one-process loss."""
    device = next(model.parameters()).device
    for part in parts(mine, data.lengths, micro_split, cfg.micro_batch_tokens):
        sums.micros += 1
        if inject_oom:
            raise torch.OutOfMemoryError("injected by FRUGALTUNE_TEST_OOM_AT_STEPS")
        with phase("data"):
            batch = {k: v.to(device) for k, v in collate([data.input_ids[i] for i in part], data.pad_token_id).items()}
            target = collate_targets([data.labels[i] for i in part], batch["input_ids"].shape[1]).to(device)
            shared = shared_prefix_length(batch["input_ids"], target, share_from)
        with phase("fwd_bwd"):
            with autocast(cfg.bf16, device):
                loss = model_loss(model, batch, target, shared=shared)
            weight = sum(data.counts[i] for i in part) / sum(data.counts[i] for i in batch_index) / cfg.grad_accum
            (loss * weight).backward()
            sums.loss += loss.item() * weight
        sums.tokens += sum(data.lengths[i] for i in part)
        sums.padded += batch["input_ids"].numel()
        sums.sequences += len(part)
        sums.shared += shared * (len(part) - 1)


def _halve_micro_batch(state: dict, cfg: LoopConfig, step: int, cause: BaseException | None, event) -> None:
    """Out of memory: every part of every batch from now on is half as wide (the effective batch is unchanged)."""
    size = math.ceil(cfg.batch_size / state["micro_split"])
    if size <= 1:
        raise OutOfMemoryAtBatchOne(
            f"out of memory at step {step} with one sequence per micro-batch. Lower tokenize.max_length, use a "
            "lighter train.method (lora/qlora) or a machine with more memory.") from cause
    state["micro_split"] *= 2
    new_size = math.ceil(cfg.batch_size / state["micro_split"])
    event(f"out of memory at step {step}: micro-batch {size} -> {new_size}, gradient accumulation "
          f"{cfg.grad_accum * state['micro_split'] // 2} -> {cfg.grad_accum * state['micro_split']} "
          f"(effective batch {cfg.batch_size * cfg.grad_accum} unchanged)")


def _resume(cfg: LoopConfig, model, optimizer, scheduler, state: dict, world: World, total_steps: int,
            event) -> tuple[int, Path | None]:
    """(first step, last good checkpoint): where the newest complete checkpoint of this run leaves off, if any."""
    if not (cfg.checkpoint_dir and cfg.resume):
        return 1, None
    found = checkpoint.latest_complete(cfg.checkpoint_dir)
    if not found:
        return 1, None
    saved = checkpoint.load_checkpoint(found, model, optimizer, scheduler)
    state.update({k: saved[k] for k in state if k in saved})  # checkpoints before a key have none
    if world.rank:  # the checkpoint holds rank 0's RNG: the others draw their own dropout masks
        torch.manual_seed(cfg.seed + world.rank + 1000 * saved["step"])
    event(f"resumed from {found.path} (step {saved['step']} of {total_steps})")
    return saved["step"] + 1, found.path


def _optimizer(model: torch.nn.Module, cfg: LoopConfig, optimizer_state: dict | None) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(_param_groups(model, cfg), weight_decay=cfg.weight_decay,
                                  fused=cfg.fused_optimizer or None)  # None: torch's own choice (foreach on CUDA)
    if optimizer_state:
        restored = optimizer.state_dict()
        restored["state"] = optimizer_state
        optimizer.load_state_dict(restored)
    return optimizer


class _ProgressLines:
    """The loop's progress as a line every `every_s` seconds, for a log: one clock read per step."""

    def __init__(self, every_s: float, total_steps: int, first_step: int, start: float):
        self.every_s, self.total, self.first, self.start = every_s, total_steps, first_step, start
        self.due, self.losses, self.tokens, self.since = start + every_s, [], 0, start

    def step(self, step: int, sums: _StepSums) -> None:
        self.losses.append(sums.loss)
        self.tokens += sums.tokens
        now = time.perf_counter()
        if now < self.due:
            return
        per_step = (now - self.start) / (step - self.first + 1)  # this process's steps: a resumed run's too
        tqdm.write(f"train: step {step}/{self.total} ({step / self.total:.0%}), loss {np.mean(self.losses):.4f}, "
                   f"{self.tokens / max(now - self.since, 1e-9):.0f} tokens/s, {_minutes(now - self.start)} in, "
                   f"ETA {_minutes(per_step * (self.total - step))}", file=sys.stdout)
        sys.stdout.flush()
        self.due, self.losses, self.tokens, self.since = now + self.every_s, [], 0, now


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _add_step(state: dict, sums: _StepSums, cfg: LoopConfig) -> None:
    state["position"] += cfg.grad_accum
    for key, value in (("tokens", sums.tokens), ("padded", sums.padded), ("sequences", sums.sequences),
                       ("shared", sums.shared), ("micros", sums.micros)):
        state[key] += value
    state["losses"].append(sums.loss)
    state["window"].append(sums.loss)


def _interrupted(stop: dict, step: int, total_steps: int, last_good: Path | None) -> TrainingInterrupted:
    where = f"checkpoint {last_good}" if last_good else "no checkpoint (checkpoints are off)"
    return TrainingInterrupted(f"{stop['signal']} at step {step} of {total_steps}: stopped after writing {where}. "
                               "Run the same `dvc repro` again (train.resume: auto) to continue from it.")


def train_classifier(
    model: torch.nn.Module,
    input_ids: list[list[int]],
    labels: list[int],
    cfg: LoopConfig,
    pad_token_id: int,
    on_log: Callable[[dict], None] | None = None,
    progress: bool = True,
    on_event: Callable[[str], None] | None = None,
    timer: StepTimer | None = None,
    world: World = World(),
    regularizer: Callable[[], torch.Tensor] | None = None,
    optimizer_state: dict | None = None,
    batches: Sequence[list[int]] | None = None,
) -> TrainResult:
    """Train `model` (already wrapped by its method) on tokenized examples; return counts, losses and timings.

    With `cfg.checkpoint_dir`, writes a checkpoint every `cfg.checkpoint_every` steps and on SIGINT/SIGTERM, and
    (`cfg.resume`) continues from the newest complete one: same data order, RNG, optimizer and schedule, so the
    resumed run ends where an uninterrupted one would.

    Under torchrun (`world.size` > 1) every rank runs this same loop on its share of each batch and the gradients
    are summed across ranks (frugaltune.training.distributed): the step is the one-process step. Only rank 0 logs,
    shows progress and writes checkpoints; counts and losses are global on every rank.

    `regularizer`, when given, is a term of the trainable weights added to each step's loss once (after the
    batch's gradients, so micro-batch splits and ranks do not scale it); the reported loss stays the task loss.
    The federated client uses it for FedProx's proximal term (frugaltune/federated/local.py).

    `batches`, when given, are the micro-batches (example indices) to run in that order, `cfg.grad_accum` a step,
    instead of the seeded length-grouped epochs: the planner's calibration runs the run's own batches it picked.

    `optimizer_state`, when given, is AdamW's per-parameter state (moments and step counts, keyed as
    `optimizer.state_dict()["state"]`): a non-empty one is where this run's optimizer starts instead of zero
    moments, and on return the dict holds the final state. The learning rates and schedule stay this run's. A
    federated client that persists between rounds uses it (`federated.client_state: kept`).
    """
    _unpack_4bit_inference_layout(model)
    lengths = [len(ids) for ids in input_ids]
    data = _Data(input_ids, labels, lengths, target_counts(labels), pad_token_id)
    total_steps = len(batches) // cfg.grad_accum if batches is not None else plan_steps(len(input_ids), cfg)
    optimizer = _optimizer(model, cfg, optimizer_state)
    # imported here: transformers.optimization costs seconds at import, and evaluation only predicts
    from transformers import get_scheduler

    scheduler = get_scheduler(cfg.scheduler, optimizer, num_warmup_steps=int(cfg.warmup_ratio * total_steps),
                              num_training_steps=total_steps)
    order = batches if batches is not None else _EpochOrder(lengths, cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    world.broadcast_parameters(trainable)
    torch.manual_seed(cfg.seed + world.rank)  # dropout: each rank draws its own masks
    on_log = on_log if world.is_main else None
    events: list[str] = []

    def event(message: str) -> None:
        events.append(message)
        tqdm.write(f"train: {message}")
        sys.stdout.flush()  # into a log file as it happens, not when a buffer fills
        if on_event:
            on_event(message)

    state = {"position": 0, "history": [], "losses": [], "window": [], "tokens": 0, "padded": 0, "sequences": 0,
             "micros": 0, "micro_split": math.ceil(cfg.batch_size / (cfg.micro_batch_size or cfg.batch_size)),
             "elapsed": 0.0, "last_window": [], "shared": 0}
    first_step, last_good = _resume(cfg, model, optimizer, scheduler, state, world, total_steps, event)
    oom_steps, step_delay = _injected_oom_steps(), _test_step_delay()
    # a run of its own (not the calibration's timed steps, not a rank among others) yields cores to other work
    sharing = CoreShare(event) if batches is None and not world.distributed else None
    checkpointing = any(getattr(module, "gradient_checkpointing", False) for module in model.modules())
    share_from = 0 if checkpointing else cfg.shared_prefix_min  # a KV cache cannot cross a checkpointed layer
    phase = timer.phase if timer is not None else (lambda name: contextlib.nullcontext())
    model.train()
    window_tokens, window_start = 0, time.perf_counter()
    start = time.perf_counter()
    stop: dict = {}
    shown = progress and world.is_main
    bar = tqdm(total=total_steps, initial=first_step - 1, desc="train", unit="step", dynamic_ncols=True,
               disable=not (shown and console.progress_bars_on() and console.is_terminal(sys.stderr)))
    lines = _ProgressLines(cfg.progress_every_s, total_steps, first_step, start) if (
        shown and not console.is_terminal(sys.stdout)) else None
    with (_stop_on_signals(stop), short_sequence_attention(model, cfg.eager_attention_max_len),
          fused_int8_lora(model, cfg.fused_int8_lora), sharing or contextlib.nullcontext()):
        step = first_step
        while step <= total_steps:
            sums, out_of_memory = _StepSums(), None
            try:
                for micro in range(cfg.grad_accum):
                    batch_index = order[state["position"] + micro]
                    _accumulate(model, data, batch_index, world.shard(batch_index), cfg, state["micro_split"],
                                share_from, phase, sums, inject_oom=step in oom_steps)
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                if not _is_oom(exc):
                    raise
                oom_steps.discard(step)
                out_of_memory = exc
            if world.any(out_of_memory is not None):  # every rank halves together, or the others would wait
                optimizer.zero_grad(set_to_none=True)
                _halve_micro_batch(state, cfg, step, out_of_memory, event)
                continue  # redo the step with smaller parts
            if world.distributed:
                with phase("all_reduce"):
                    world.all_reduce_gradients(trainable)
                    loss, tokens, padded, sequences = world.sum([sums.loss, sums.tokens, sums.padded, sums.sequences])
                    sums.loss, sums.tokens, sums.padded, sums.sequences = loss, int(tokens), int(padded), int(sequences)
            if regularizer is not None:  # after the all-reduce: every rank adds the same gradient once
                with phase("fwd_bwd"):
                    regularizer().backward()
            if not math.isfinite(sums.loss):
                where = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was written yet"
                raise DivergenceError(f"loss is {sums.loss} at step {step}: training diverged ({where}). Lower "
                                      f"train.lr (now {cfg.lr}) or use train.precision: fp32.")
            with phase("optimizer"):
                torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if timer is not None:
                timer.end_step()
            if sharing is not None:
                sharing.after_step()
            if step_delay:
                _test_sleep(step_delay, stop)
            _add_step(state, sums, cfg)
            window_tokens += sums.tokens
            bar.update(1)
            if lines is not None:
                lines.step(step, sums)
            if step % cfg.log_every == 0 or step == total_steps:
                now = time.perf_counter()
                record = {"step": step, "loss": float(np.mean(state["window"])), "lr": scheduler.get_last_lr()[0],
                          "tokens_per_s": window_tokens / max(now - window_start, 1e-9),
                          "elapsed_s": state["elapsed"] + now - start, **(timer.window() if timer else {})}
                state["history"].append(record)
                bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
                if on_log:
                    on_log(record)
                state["last_window"], state["window"] = state["window"], []
                window_tokens, window_start = 0, now
            if world.distributed and world.any(bool(stop)):  # a signal on one rank stops all at the same step
                stop.setdefault("signal", "SIGTERM")
            if cfg.checkpoint_dir and step < total_steps and (step % cfg.checkpoint_every == 0 or stop):
                # every rank holds the same weights and optimizer state: one writes them
                last_good = checkpoint.save_checkpoint(
                    cfg.checkpoint_dir, step, model, optimizer, scheduler,
                    {**state, "elapsed": state["elapsed"] + time.perf_counter() - start}, cfg.keep_checkpoints,
                ) if world.is_main else cfg.checkpoint_dir / f"step-{step}"
            if stop:
                world.barrier()  # the checkpoint is on disk before any rank exits (torchrun then stops them all)
                bar.close()
                raise _interrupted(stop, step, total_steps, last_good)
            step += 1
    bar.close()
    if optimizer_state is not None:
        optimizer_state.clear()
        optimizer_state.update(optimizer.state_dict()["state"])
    return TrainResult(
        steps=total_steps, micro_batches=state["micros"], sequences=state["sequences"], tokens=state["tokens"],
        padded_tokens=state["padded"], wall_seconds=state["elapsed"] + time.perf_counter() - start,
        final_loss=float(np.mean(state.get("last_window") or state["losses"][-1:])),
        mean_loss=float(np.mean(state["losses"])), peak_rss_mb=peak_rss_mb(), history=state["history"],
        resumed_from_step=first_step - 1, micro_batch_size=math.ceil(cfg.batch_size / state["micro_split"]),
        events=events, shared_prefix_tokens=state["shared"],
    )


@torch.no_grad()
def predict(model: torch.nn.Module, input_ids: list[list[int]], pad_token_id: int, batch_size: int = 32,
            bf16: bool = False, progress: bool = True) -> np.ndarray:
    """Class ids for every example, in input order."""
    device = next(model.parameters()).device
    model.eval()
    predictions = np.zeros(len(input_ids), dtype=np.int64)
    batches = sorted_batches([len(ids) for ids in input_ids], batch_size)
    for batch_index in tqdm(batches, desc="predict", disable=not (progress and console.progress_bars_on()),
                            dynamic_ncols=True):
        batch = {k: v.to(device) for k, v in collate([input_ids[i] for i in batch_index], pad_token_id).items()}
        with autocast(bf16, device):
            logits = model(**batch).logits
        predictions[batch_index] = logits.float().argmax(-1).cpu().numpy()
    return predictions


@torch.no_grad()
def lm_loss(model: torch.nn.Module, input_ids: list[list[int]], labels: list[list[int]], pad_token_id: int,
            batch_size: int = 32, bf16: bool = False, progress: bool = True) -> tuple[float, int]:
    """causal_lm: the mean cross-entropy per response token over all examples, and the number of those tokens.
    Summed per batch (not a mean of batch means), so the figure does not depend on the batch size."""
    device = next(model.parameters()).device
    model.eval()
    total, count = 0.0, 0
    for batch_index in tqdm(sorted_batches([len(ids) for ids in input_ids], batch_size), desc="loss",
                            disable=not (progress and console.progress_bars_on()), dynamic_ncols=True):
        batch = {k: v.to(device) for k, v in collate([input_ids[i] for i in batch_index], pad_token_id).items()}
        target = collate_targets([labels[i] for i in batch_index], batch["input_ids"].shape[1]).to(device)
        shared = shared_prefix_length(batch["input_ids"], target, LoopConfig.shared_prefix_min)
        with autocast(bf16, device):
            total += model_loss(model, batch, target, reduction="sum", shared=shared).item()
        count += int((target[:, 1:] != IGNORE_INDEX).sum())
    return total / max(count, 1), count
