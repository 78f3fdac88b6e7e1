"""The training loop (sequence classification or causal LM): length-grouped batches, bf16 autocast, grad accumulation.

Library code; the `train` stage (`python -m stages.train`) calls `train_classifier`. Its parts in siblings:
`inference` (a batch's loss; evaluation's forward passes), `optimizer` (AdamW, the schedule), `oom` (parts halved
on out of memory), `signals` (SIGINT/SIGTERM: stop at a step's end), `fast` (the speed paths). Where stdout is not
a terminal (a log, a pipe), progress comes as a line every `LoopConfig.reporting.progress_every_s` seconds
(`ProgressLines`) instead of tqdm's bar.
A plain loop rather than HF `Trainer`: it holds no padding, no per-step Python overhead we do not need, and it is
the place where resume, OOM back-off and telemetry hook in.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from frugaltune import console
from frugaltune.telemetry import StepTimer
from frugaltune.training import checkpoint
from frugaltune.classify import collate
from frugaltune.training.batching import collate_targets, epoch_batches, parts, target_counts
from frugaltune.training.distributed import World
from frugaltune.training.sharing import CoreShare
from frugaltune.training.fast import fused_int8_lora, short_sequence_attention
from frugaltune.training.inference import autocast, model_loss, shared_prefix_length
from frugaltune.training.loop_config import LoopConfig
from frugaltune.training.oom import halve_micro_batch, injected_oom_steps, is_oom
from frugaltune.training.optimizer import build_optimizer, build_scheduler
from frugaltune.training.signals import interrupted, stop_on_signals


class ProgressLines:
    """The loop's progress as a line every `every_s` seconds, for a log: one clock read per step."""

    def __init__(self, every_s: float, total_steps: int, first_step: int, start: float):
        self.every_s, self.total, self.first, self.start = every_s, total_steps, first_step, start
        self.due, self.losses, self.tokens, self.since = start + every_s, [], 0, start

    def step(self, step: int, loss: float, tokens: int) -> None:
        self.losses.append(loss)
        self.tokens += tokens
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


class DivergenceError(RuntimeError):
    """The loss became NaN or infinite; the message names the step and the last good checkpoint."""


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


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) as peft counts them: a 4-bit weight packs two values per byte and counts as both."""
    if hasattr(model, "get_nb_trainable_parameters"):  # a PeftModel
        trainable, total = model.get_nb_trainable_parameters()
        return int(trainable), int(total)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def plan_steps(num_examples: int, cfg: LoopConfig) -> int:
    micro_per_epoch = math.ceil(num_examples / cfg.batching.batch_size)
    steps_per_epoch = math.ceil(micro_per_epoch / cfg.batching.grad_accum)
    return cfg.batching.max_steps or max(1, math.ceil(cfg.batching.epochs * steps_per_epoch))


class _EpochOrder:
    """Micro-batch `i` of the whole run, recomputable from the seed alone: resuming needs only the position."""

    def __init__(self, lengths: list[int], cfg: LoopConfig):
        self.lengths, self.cfg, self._epoch, self._batches = lengths, cfg, -1, []
        self.per_epoch = math.ceil(len(lengths) / cfg.batching.batch_size)

    def __getitem__(self, position: int) -> list[int]:
        epoch, index = divmod(position, self.per_epoch)
        if epoch != self._epoch:
            self._batches = epoch_batches(self.lengths, self.cfg.batching.batch_size, self.cfg.seed, epoch,
                                          self.cfg.batching.group_by_length)
            self._epoch = epoch
        return self._batches[index]


def _test_step_delay() -> float:
    """Test hook: FRUGALTUNE_TEST_STEP_DELAY_S slows each step so that a test can kill a run mid-way."""
    return float(os.environ.get("FRUGALTUNE_TEST_STEP_DELAY_S", "0") or 0)


def _test_sleep(seconds: float, stop: dict) -> None:
    """The test hook's delay, cut short by a stop signal: a stopped run then takes as long as a real one to end."""
    end = time.monotonic() + seconds
    while not stop and time.monotonic() < end:
        time.sleep(min(0.05, max(end - time.monotonic(), 0.0)))


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
    for part in parts(mine, data.lengths, micro_split, cfg.batching.micro_batch_tokens):
        sums.micros += 1
        if inject_oom:
            raise torch.OutOfMemoryError("injected by FRUGALTUNE_TEST_OOM_AT_STEPS")
        with phase("data"):
            batch = {k: v.to(device) for k, v in collate([data.input_ids[i] for i in part], data.pad_token_id).items()}
            target = collate_targets([data.labels[i] for i in part], batch["input_ids"].shape[1]).to(device)
            shared = shared_prefix_length(batch["input_ids"], target, share_from)
        with phase("fwd_bwd"):
            with autocast(cfg.speed.bf16, device):
                loss = model_loss(model, batch, target, shared=shared)
            weight = (sum(data.counts[i] for i in part) / sum(data.counts[i] for i in batch_index)
                      / cfg.batching.grad_accum)
            (loss * weight).backward()
            sums.loss += loss.item() * weight
        sums.tokens += sum(data.lengths[i] for i in part)
        sums.padded += batch["input_ids"].numel()
        sums.sequences += len(part)
        sums.shared += shared * (len(part) - 1)


def _resume(cfg: LoopConfig, model, optimizer, scheduler, state: dict, world: World, total_steps: int,
            event) -> tuple[int, Path | None]:
    """(first step, last good checkpoint): where the newest complete checkpoint of this run leaves off, if any."""
    if not (cfg.checkpoints.checkpoint_dir and cfg.checkpoints.resume):
        return 1, None
    found = checkpoint.latest_complete(cfg.checkpoints.checkpoint_dir)
    if not found:
        return 1, None
    saved = checkpoint.load_checkpoint(found, model, optimizer, scheduler)
    state.update({k: saved[k] for k in state if k in saved})  # checkpoints before a key have none
    if world.rank:  # the checkpoint holds rank 0's RNG: the others draw their own dropout masks
        torch.manual_seed(cfg.seed + world.rank + 1000 * saved["step"])
    event(f"resumed from {found.path} (step {saved['step']} of {total_steps})")
    return saved["step"] + 1, found.path


def _add_step(state: dict, sums: _StepSums, cfg: LoopConfig) -> None:
    state["position"] += cfg.batching.grad_accum
    for key, value in (("tokens", sums.tokens), ("padded", sums.padded), ("sequences", sums.sequences),
                       ("shared", sums.shared), ("micros", sums.micros)):
        state[key] += value
    state["losses"].append(sums.loss)
    state["window"].append(sums.loss)


def _new_state(cfg: LoopConfig) -> dict:
    """What a checkpoint keeps of the loop's progress (besides weights, optimizer and schedule), at the start."""
    batch, micro = cfg.batching.batch_size, cfg.batching.micro_batch_size
    return {"position": 0, "history": [], "losses": [], "window": [], "tokens": 0, "padded": 0, "sequences": 0,
            "micros": 0, "micro_split": math.ceil(batch / (micro or batch)),
            "elapsed": 0.0, "last_window": [], "shared": 0}


def _event_sink(events: list[str], on_event: Callable[[str], None] | None) -> Callable[[str], None]:
    """What the run says happened (resumed, out of memory, fewer threads): kept in `events`, printed, passed on."""

    def event(message: str) -> None:
        events.append(message)
        tqdm.write(f"train: {message}")
        sys.stdout.flush()  # into a log file as it happens, not when a buffer fills
        if on_event:
            on_event(message)

    return event


def _displays(shown: bool, cfg: LoopConfig, total_steps: int, first_step: int, start: float):
    """(tqdm's bar, shown on a terminal's stderr; progress lines where stdout is not a terminal, else None)."""
    bar = tqdm(total=total_steps, initial=first_step - 1, desc="train", unit="step", dynamic_ncols=True,
               disable=not (shown and console.progress_bars_on() and console.is_terminal(sys.stderr)))
    lines = ProgressLines(cfg.reporting.progress_every_s, total_steps, first_step, start) if (
        shown and not console.is_terminal(sys.stdout)) else None
    return bar, lines


def _gradients(model: torch.nn.Module, data: _Data, order: Sequence[list[int]], state: dict, cfg: LoopConfig,
               world: World, share_from: int, phase, step: int, oom_steps: set[int], optimizer: torch.optim.Optimizer,
               event) -> _StepSums | None:
    """Forward and backward of the step's micro-batches, this rank's share; None after running out of memory on any
    rank: every rank then halves its parts, its gradients dropped, and runs the step again."""
    sums, out_of_memory = _StepSums(), None
    try:
        for micro in range(cfg.batching.grad_accum):
            batch_index = order[state["position"] + micro]
            _accumulate(model, data, batch_index, world.shard(batch_index), cfg, state["micro_split"],
                        share_from, phase, sums, inject_oom=step in oom_steps)
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not is_oom(exc):
            raise
        oom_steps.discard(step)
        out_of_memory = exc
    if world.any(out_of_memory is not None):  # every rank halves together, or the others would wait
        optimizer.zero_grad(set_to_none=True)
        halve_micro_batch(state, cfg.batching, step, out_of_memory, event)
        return None
    return sums


def _optimizer_step(sums: _StepSums, step: int, cfg: LoopConfig, world: World, trainable: list, optimizer,
                    scheduler, regularizer, phase, last_good: Path | None) -> None:
    """The ranks' gradients and counts summed, the regularizer's gradient added, the loss checked, the update."""
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
                              f"train.lr (now {cfg.optim.lr}) or use train.precision: fp32.")
    with phase("optimizer"):
        torch.nn.utils.clip_grad_norm_(trainable, cfg.optim.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def _log_window(state: dict, step: int, scheduler, window_tokens: int, window_start: float, start: float,
                timer: StepTimer | None, bar, on_log: Callable[[dict], None] | None) -> float:
    """The logging window's record (mean loss, learning rate, tokens/s, the timer's phases) into the history, the
    bar and `on_log`; returns when the next window starts."""
    now = time.perf_counter()
    record = {"step": step, "loss": float(np.mean(state["window"])), "lr": scheduler.get_last_lr()[0],
              "tokens_per_s": window_tokens / max(now - window_start, 1e-9),
              "elapsed_s": state["elapsed"] + now - start, **(timer.window() if timer else {})}
    state["history"].append(record)
    bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
    if on_log:
        on_log(record)
    state["last_window"], state["window"] = state["window"], []
    return now


def _checkpoint_or_stop(stop: dict, step: int, total_steps: int, cfg: LoopConfig, world: World, model, optimizer,
                        scheduler, state: dict, start: float, last_good: Path | None, bar) -> Path | None:
    """After a step: a checkpoint when one is due or a signal arrived (on any rank), then on a signal the stop;
    returns the last good checkpoint."""
    if world.distributed and world.any(bool(stop)):  # a signal on one rank stops all at the same step
        stop.setdefault("signal", "SIGTERM")
    saving = cfg.checkpoints
    if saving.checkpoint_dir and step < total_steps and (step % saving.checkpoint_every == 0 or stop):
        # every rank holds the same weights and optimizer state: one writes them
        last_good = checkpoint.save_checkpoint(
            saving.checkpoint_dir, step, model, optimizer, scheduler,
            {**state, "elapsed": state["elapsed"] + time.perf_counter() - start}, saving.keep_checkpoints,
        ) if world.is_main else saving.checkpoint_dir / f"step-{step}"
    if stop:
        world.barrier()  # the checkpoint is on disk before any rank exits (torchrun then stops them all)
        bar.close()
        raise interrupted(stop, step, total_steps, last_good)
    return last_good


def _result(state: dict, cfg: LoopConfig, total_steps: int, start: float, first_step: int,
            events: list[str]) -> TrainResult:
    return TrainResult(
        steps=total_steps, micro_batches=state["micros"], sequences=state["sequences"], tokens=state["tokens"],
        padded_tokens=state["padded"], wall_seconds=state["elapsed"] + time.perf_counter() - start,
        final_loss=float(np.mean(state.get("last_window") or state["losses"][-1:])),
        mean_loss=float(np.mean(state["losses"])), peak_rss_mb=peak_rss_mb(), history=state["history"],
        resumed_from_step=first_step - 1, micro_batch_size=math.ceil(cfg.batching.batch_size / state["micro_split"]),
        events=events, shared_prefix_tokens=state["shared"],
    )


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

    With `cfg.checkpoints.checkpoint_dir`, writes a checkpoint every `checkpoint_every` steps and on SIGINT/SIGTERM,
    and (`resume`) continues from the newest complete one: same data order, RNG, optimizer and schedule, so the
    resumed run ends where an uninterrupted one would.

    Under torchrun (`world.size` > 1) every rank runs this same loop on its share of each batch and the gradients
    are summed across ranks (frugaltune.training.distributed): the step is the one-process step. Only rank 0 logs,
    shows progress and writes checkpoints; counts and losses are global on every rank.

    `regularizer`, when given, is a term of the trainable weights added to each step's loss once (after the
    batch's gradients, so micro-batch splits and ranks do not scale it); the reported loss stays the task loss.
    The federated client uses it for FedProx's proximal term (frugaltune/federated/local.py).

    `batches`, when given, are the micro-batches (example indices) to run in that order, `cfg.batching.grad_accum` a
    step, instead of the seeded length-grouped epochs: the planner's calibration runs the run's own batches it picked.

    `optimizer_state`, when given, is AdamW's per-parameter state (moments and step counts, keyed as
    `optimizer.state_dict()["state"]`): a non-empty one is where this run's optimizer starts instead of zero
    moments, and on return the dict holds the final state. The learning rates and schedule stay this run's. A
    federated client that persists between rounds uses it (`federated.client_state: kept`).
    """
    _unpack_4bit_inference_layout(model)
    lengths = [len(ids) for ids in input_ids]
    data = _Data(input_ids, labels, lengths, target_counts(labels), pad_token_id)
    total_steps = len(batches) // cfg.batching.grad_accum if batches is not None else plan_steps(len(input_ids), cfg)
    optimizer = build_optimizer(model, cfg, optimizer_state)
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    order = batches if batches is not None else _EpochOrder(lengths, cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    world.broadcast_parameters(trainable)
    torch.manual_seed(cfg.seed + world.rank)  # dropout: each rank draws its own masks
    on_log = on_log if world.is_main else None
    events: list[str] = []
    event = _event_sink(events, on_event)
    state = _new_state(cfg)
    first_step, last_good = _resume(cfg, model, optimizer, scheduler, state, world, total_steps, event)
    oom_steps, step_delay = injected_oom_steps(), _test_step_delay()
    # a run of its own (not the calibration's timed steps, not a rank among others) on more than one thread yields
    # cores to other work: on one there is nothing to give up, and no /proc/stat to read every step
    sharing = CoreShare(event) if batches is None and not world.distributed and torch.get_num_threads() > 1 else None
    checkpointing = any(getattr(module, "gradient_checkpointing", False) for module in model.modules())
    share_from = 0 if checkpointing else cfg.speed.shared_prefix_min  # a KV cache cannot cross a checkpointed layer
    phase = timer.phase if timer is not None else (lambda name: contextlib.nullcontext())
    model.train()
    window_tokens, window_start = 0, time.perf_counter()
    start = time.perf_counter()
    stop: dict = {}
    bar, lines = _displays(progress and world.is_main, cfg, total_steps, first_step, start)
    with (stop_on_signals(stop), short_sequence_attention(model, cfg.speed.eager_attention_max_len),
          fused_int8_lora(model, cfg.speed.fused_int8_lora), sharing or contextlib.nullcontext()):
        step = first_step
        while step <= total_steps:
            sums = _gradients(model, data, order, state, cfg, world, share_from, phase, step, oom_steps, optimizer,
                              event)
            if sums is None:
                continue  # out of memory: redo the step with smaller parts
            _optimizer_step(sums, step, cfg, world, trainable, optimizer, scheduler, regularizer, phase, last_good)
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
                lines.step(step, sums.loss, sums.tokens)
            if step % cfg.reporting.log_every == 0 or step == total_steps:
                window_start = _log_window(state, step, scheduler, window_tokens, window_start, start, timer, bar,
                                           on_log)
                window_tokens = 0
            last_good = _checkpoint_or_stop(stop, step, total_steps, cfg, world, model, optimizer, scheduler, state,
                                            start, last_good, bar)
            step += 1
    bar.close()
    if optimizer_state is not None:
        optimizer_state.clear()
        optimizer_state.update(optimizer.state_dict()["state"])
    return _result(state, cfg, total_steps, start, first_step, events)
