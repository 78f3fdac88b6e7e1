"""Telemetry overhead on training throughput: the same LoRA training with telemetry on and off, alternating.

    python benchmarks/telemetry_overhead.py                 # 7 runs of each mode, twice (~2-3 min on 2 cores)
    python benchmarks/telemetry_overhead.py --reps 3 --steps 20

The workload is a small random llama (hidden 256, 4 layers) as a sequence classifier with LoRA on q/v through
`frugaltune.training.methods.apply_lora`, fed by the real `collate` on random token sequences of varied length,
AdamW with gradient clipping: the shape of the `train` stage, small enough for a CPU. "On" means what the train
stage runs: a `TelemetrySampler` at the given interval writing its CSV and `system/...` metrics to an MLflow run in
a temporary sqlite store (a batch every 10 s, `--flush`), and a `StepTimer` around the three phases of every step.
"Off" is the bare loop.

Each run is timed over the training loop only (the sampler is started before and stopped after it; their one-time
costs are printed separately). The runs alternate off/on after an untimed warm-up so drifts in machine load hit
both alike; the result is the ratio of the median throughputs. On a shared machine the run-to-run noise (several
percent) hides a 1% effect, so a second pass samples and flushes to MLflow 20 times as often (`--amplify`): its
overhead is large enough to measure, and divided by 20 it estimates the overhead at the default rates, since the
cost is paid per sample and per flush (the timed runs of the first pass are shorter than one flush interval). Each
pass also prints the sampler's own CPU time and the time it was at work, measured in its thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
from mlflow import MlflowClient
from transformers import LlamaConfig, LlamaForSequenceClassification

from frugaltune.telemetry import StepTimer, TelemetrySampler
from frugaltune.classify import collate
from frugaltune.training.methods import apply_lora

VOCAB = 4096
PAD = 0


def build_model(seed: int = 0) -> torch.nn.Module:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         num_labels=4, pad_token_id=PAD)
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config)
    return apply_lora(model, r=8, alpha=16, dropout=0.0, target_modules=["q_proj", "v_proj"])


def make_batches(steps: int, batch_size: int, seed: int = 0) -> list[tuple[list[list[int]], list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        lengths = torch.randint(48, 129, (batch_size,), generator=generator).tolist()
        ids = [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in lengths]
        batches.append((ids, torch.randint(0, 4, (batch_size,), generator=generator).tolist()))
    return batches


def train(model: torch.nn.Module, batches: list, timer: StepTimer | None) -> tuple[float, int]:
    """One pass over `batches`; returns (seconds, useful tokens). Phases are timed only when a timer is given."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    phase = timer.phase if timer is not None else (lambda name: nullcontext())
    tokens = 0
    model.train()
    start = time.perf_counter()
    for ids, labels in batches:
        with phase("data"):
            batch = collate(ids, PAD)
            target = torch.tensor(labels)
        with phase("fwd_bwd"):
            loss = model(**batch, labels=target).loss
            loss.backward()
            loss.item()
        with phase("optimizer"):
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if timer is not None:
            timer.end_step()
        tokens += sum(len(seq) for seq in ids)
    return time.perf_counter() - start, tokens


@dataclass
class Comparison:
    off: list[float] = field(default_factory=list)  # tokens/s of each run, in run order
    on: list[float] = field(default_factory=list)
    cpu_percent: list[float] = field(default_factory=list)  # the sampler's own CPU, % of one core, per on-run
    busy_percent: list[float] = field(default_factory=list)  # the sampler's wall time at work, % of the run
    samples: list[int] = field(default_factory=list)
    start_s: list[float] = field(default_factory=list)
    stop_s: list[float] = field(default_factory=list)
    last_summary: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return statistics.median(self.on) / statistics.median(self.off)

    @property
    def pair_ratios(self) -> list[float]:
        return [on / off for on, off in zip(self.on, self.off)]


def compare(model, batches, reps: int, interval: float, flush: float, threads: int, client: MlflowClient,
            experiment_id: str, workdir: Path, label: str) -> Comparison:
    """`reps` runs with telemetry off and on, alternating (off-on, on-off, ...) so drifts in load hit both alike."""
    result = Comparison()
    for rep in range(reps):
        for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            if mode == "off":
                seconds, tokens = train(model, batches, None)
                result.off.append(tokens / seconds)
            else:
                run_id = client.create_run(experiment_id, run_name=f"{label}-{rep}").info.run_id
                sampler = TelemetrySampler(interval, csv_path=workdir / f"{label}_{rep}.csv", mlflow_run_id=run_id,
                                           tracking_uri=client.tracking_uri, cores=threads, mlflow_flush_s=flush)
                t0 = time.perf_counter()
                sampler.start()
                result.start_s.append(time.perf_counter() - t0)
                timer = StepTimer()
                seconds, tokens = train(model, batches, timer)
                t0 = time.perf_counter()
                sampler.stop()
                result.stop_s.append(time.perf_counter() - t0)
                summary = sampler.summary(timer)
                client.set_terminated(run_id)
                result.on.append(tokens / seconds)
                result.cpu_percent.append(summary["telemetry_cpu_percent"])
                result.busy_percent.append(summary["telemetry_busy_percent"])
                result.samples.append(summary["samples"])
                result.last_summary = summary
            print(f"  {label} {rep + 1}/{reps} {mode:>3}: {tokens / seconds:8.1f} tokens/s ({seconds:.2f} s)",
                  flush=True)
    return result


def report(label: str, result: Comparison) -> None:
    pairs = result.pair_ratios
    print(f"{label}: median throughput off {statistics.median(result.off):.1f}, on {statistics.median(result.on):.1f} "
          f"tokens/s; ratio on/off {result.ratio:.4f}, overhead {100 * (1 - result.ratio):+.2f}% "
          f"(median pair ratio {statistics.median(pairs):.4f}, pairs {min(pairs):.3f}..{max(pairs):.3f})")
    print(f"{' ' * len(label)}  sampler's own cost per run: {statistics.median(result.cpu_percent):.3f}% of one core "
          f"CPU, at work {statistics.median(result.busy_percent):.3f}% of the time, "
          f"{statistics.median(result.samples):.0f} samples (medians)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7, help="timed runs of each mode (median taken)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--interval", type=float, default=1.0, help="telemetry sampling interval, seconds")
    parser.add_argument("--flush", type=float, default=10.0,
                        help="seconds between MLflow batches (the sampler's default, as in the train stage)")
    parser.add_argument("--amplify", type=float, default=20.0,
                        help="second pass: sample and flush this many times faster, then scale the overhead back "
                             "(0: skip)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: the physical cores, as the train stage resolves them)")
    args = parser.parse_args()
    threads = args.threads or psutil.cpu_count(logical=False) or torch.get_num_threads()
    torch.set_num_threads(threads)

    load_before = os.getloadavg()
    model = build_model()
    batches = make_batches(args.steps, args.batch_size)
    workdir = Path(tempfile.mkdtemp(prefix="telemetry-bench-"))
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    experiment_id = client.create_experiment("telemetry-overhead", artifact_location=(workdir / "art").as_uri())
    print(f"workload: llama hidden 256 x 4 layers + LoRA r=8 (q,v), {args.steps} steps of batch {args.batch_size}, "
          f"{threads} torch threads; telemetry every {args.interval} s, MLflow flush every {args.flush} s "
          f"({client.tracking_uri})")

    # Warm-up over every batch: each new sequence length pays a first-call cost (allocator, oneDNN primitives).
    train(model, batches, None)
    default = compare(model, batches, args.reps, args.interval, args.flush, threads, client, experiment_id, workdir,
                      "default")
    amplified = None
    if args.amplify:
        amplified = compare(model, batches, args.reps, args.interval / args.amplify, args.flush / args.amplify,
                            threads, client, experiment_id, workdir, f"x{args.amplify:g}")
    load_after = os.getloadavg()

    print()
    report(f"at {args.interval} s", default)
    if amplified is not None:
        label = f"at {args.interval / args.amplify:g} s"
        report(label, amplified)
        scaled = (1 - amplified.ratio) / args.amplify
        print(f"{' ' * len(label)}  overhead / {args.amplify:g} = {100 * scaled:+.3f}%: the overhead at "
              f"{args.interval} s estimated from a {args.amplify:g}x larger, measurable one (the cost is per sample)")
    print(f"one-time costs: start {1000 * statistics.median(default.start_s):.1f} ms, "
          f"stop {1000 * statistics.median(default.stop_s):.1f} ms (last sample + MLflow flush)")
    split = default.last_summary
    print(f"step split (last run): {split.get('data_share', 0):.1%} data, {split.get('fwd_bwd_share', 0):.1%} "
          f"fwd-bwd, {split.get('optimizer_share', 0):.1%} optimizer, {split.get('other_share', 0):.1%} other")
    print(f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after, on {os.cpu_count()} CPUs"
          + ("  (machine shared with other work: expect run-to-run noise)"
             if max(load_before[0], load_after[0]) > (os.cpu_count() or 1) / 2 else ""))


if __name__ == "__main__":
    main()
