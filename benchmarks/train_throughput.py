"""Training throughput: frugaltune's LoRA training against two Hugging Face `Trainer` recipes, in one run.

    python benchmarks/train_throughput.py                  # default model + data of the pipeline, 20 steps each
    python benchmarks/train_throughput.py --steps 10 --batch-size 8

Needs `models/base` and `data/tokenized` (run `make pipeline`, or `dvc repro tokenize`). Every recipe trains the
same LoRA (peft, r=8 on q/k/v/o, the seeded classification head) on the same sequences (the first
steps x batch-size examples of the training split, one pass), with AdamW at the same rate, on the same threads:

- frugaltune: `frugaltune.training.loop.train_classifier` (length-grouped batches, dynamic padding, fp32 or bf16
  as the kernels stage chose) — what `dvc repro train` runs;
- (a) the common recipe: HF `Trainer` + peft, `padding="max_length", max_length=128`, fp32;
- (b) a tuned HF `Trainer`: `train_sampling_strategy="group_by_length"`, dynamic padding (`DataCollatorWithPadding`),
  bf16 autocast.

Each recipe runs in its own subprocess, so its peak RSS is its own. Reported per recipe: useful (non-pad)
tokens/s over the training loop (model loading excluded; the first step included for all alike), the padding
share, peak RSS, and MFU = useful-token FLOPs/s / CPU peak, where

    FLOPs per useful token = 4 N + 12 L s h   (N: matmul parameters; LoRA trains no base weight, so backward is
                                               one input-gradient pass, 2N, on top of the 2N forward; attention:
                                               4 L s h forward for QK^T and AV, x3 with backward; s: mean length)
    CPU peak = cores x clock x fp32 FLOPs/cycle (frugaltune.hardware.cpu_peak_flops: AVX-512 = 64 on Intel)

Padded tokens are computed but not useful: MFU over useful tokens charges padding to the recipe that adds it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECIPES = ("frugaltune", "hf_max_length_fp32", "hf_group_by_length_bf16")
LABELS_FILE = Path("data/splits/labels.json")
BASE = Path("models/base")
TOKENIZED = Path("data/tokenized")


def _examples(count: int) -> tuple[list[list[int]], list[int]]:
    from datasets import load_from_disk

    train = load_from_disk(str(TOKENIZED))["train"].select(range(count))
    return [list(ids) for ids in train["input_ids"]], list(train["labels"])


def _model(bf16: bool):
    from frugaltune.models import load_tokenizer
    from frugaltune.planner import MethodKnobs
    from frugaltune.training.methods import prepare_model

    labels = json.loads(LABELS_FILE.read_text())["labels"]
    tokenizer = load_tokenizer(BASE)
    return prepare_model(BASE, labels, tokenizer.pad_token_id, 42, "lora", MethodKnobs(), bf16), tokenizer


def run_recipe(recipe: str, steps: int, batch_size: int, lr: float, threads: int, bf16_ours: bool) -> dict:
    import torch

    torch.set_num_threads(threads)
    ids, labels = _examples(steps * batch_size)
    useful = sum(len(x) for x in ids)
    if recipe == "frugaltune":
        from frugaltune.training.loop import LoopConfig, train_classifier

        model, tokenizer = _model(bf16_ours)
        cfg = LoopConfig(lr=lr, head_lr=2 * lr, batch_size=batch_size, epochs=1, seed=42, bf16=bf16_ours,
                         log_every=steps)
        result = train_classifier(model, ids, labels, cfg, tokenizer.pad_token_id, progress=False)
        return {"seconds": result.wall_seconds, "useful_tokens": result.tokens, "padded_tokens": result.padded_tokens,
                "steps": result.steps, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "bf16": bf16_ours}

    from datasets import Dataset
    from transformers import DataCollatorWithPadding, Trainer, TrainerCallback, TrainingArguments

    max_length = recipe == "hf_max_length_fp32"
    bf16 = not max_length
    model, tokenizer = _model(False)
    if max_length:  # the common recipe: every sequence padded to 128 when tokenized
        pad = tokenizer.pad_token_id
        rows = {"input_ids": [x + [pad] * (128 - len(x)) for x in ids],
                "attention_mask": [[1] * len(x) + [0] * (128 - len(x)) for x in ids], "labels": labels}
        collator = None
    else:
        rows = {"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids], "labels": labels}
        collator = DataCollatorWithPadding(tokenizer)
    dataset = Dataset.from_dict(rows)
    padded = {"tokens": 0}

    class Clock(TrainerCallback):  # times the training loop only, as for frugaltune
        def on_train_begin(self, args, state, control, **kwargs):
            padded["start"] = time.perf_counter()

        def on_train_end(self, args, state, control, **kwargs):
            padded["end"] = time.perf_counter()

    class CountingTrainer(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            padded["tokens"] += int(inputs["input_ids"].numel())
            return super().compute_loss(model, inputs, *args, **kwargs)

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=batch_size, num_train_epochs=1, learning_rate=lr,
            lr_scheduler_type="linear", warmup_steps=0.05,  # a float < 1: a ratio (transformers 5)
            weight_decay=0.0, max_grad_norm=1.0, seed=42,
            use_cpu=True, bf16=bf16, save_strategy="no", report_to="none", logging_steps=steps,
            disable_tqdm=True, dataloader_num_workers=0,
            train_sampling_strategy="group_by_length" if not max_length else "random",
        )
        trainer = CountingTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                                  callbacks=[Clock()])
        state = trainer.train()
    return {"seconds": padded["end"] - padded["start"], "useful_tokens": useful, "padded_tokens": padded["tokens"],
            "steps": state.global_step, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "bf16": bf16}


def flops_per_token(mean_length: float) -> float:
    from transformers import AutoConfig

    from frugaltune.planner import model_shape

    config = AutoConfig.from_pretrained(str(BASE))
    labels = json.loads(LABELS_FILE.read_text())["labels"]
    shape = model_shape(BASE, len(labels), "lora")
    return 4 * shape.matmul_params + 12 * config.num_hidden_layers * mean_length * config.hidden_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=None, help="default: physical cores")
    parser.add_argument("--recipe", choices=RECIPES, help=argparse.SUPPRESS)  # a child process: one recipe
    parser.add_argument("--bf16-ours", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    from frugaltune.hardware import cpu_peak_flops, probe

    hw = probe(use_nvml=False)
    threads = args.threads or hw["cpu"]["physical_cores"] or os.cpu_count()
    if args.recipe:
        print(json.dumps(run_recipe(args.recipe, args.steps, args.batch_size, args.lr, threads, args.bf16_ours)))
        return
    for needed in (BASE, TOKENIZED, LABELS_FILE):
        if not needed.exists():
            sys.exit(f"{needed} is missing: run `make pipeline` (or `dvc repro tokenize`) first.")
    kernels = Path("reports/kernels.json")
    from frugaltune import planner

    bf16_ours, _ = planner.recommend_precision(
        hw, "auto", planner.measured_on(hw, json.loads(kernels.read_text()) if kernels.exists() else None))
    peak, formula = cpu_peak_flops(hw, threads)
    results = {}
    for recipe in RECIPES:
        cmd = [sys.executable, __file__, "--recipe", recipe, "--steps", str(args.steps), "--batch-size",
               str(args.batch_size), "--lr", str(args.lr), "--threads", str(threads)] + (
            ["--bf16-ours"] if bf16_ours else [])
        print(f"running {recipe} ...", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
        if proc.returncode != 0:
            sys.exit(f"{recipe} failed:\n{proc.stderr[-3000:]}")
        results[recipe] = json.loads(proc.stdout.strip().splitlines()[-1])

    ids, _ = _examples(args.steps * args.batch_size)
    per_token = flops_per_token(sum(len(x) for x in ids) / len(ids))
    print(f"\nLoRA r=8 on {BASE}, {args.steps * args.batch_size} training sequences (one pass, batch "
          f"{args.batch_size}), {threads} threads. CPU peak: {formula}.")
    print(f"FLOPs per useful token: 4N + 12 L s h = {per_token / 1e6:.0f} MFLOP\n")
    print(f"{'recipe':28s} {'steps':>5s} {'seconds':>8s} {'useful tok/s':>12s} {'padding':>8s} {'peak RSS MB':>11s} "
          f"{'MFU':>6s} {'frugaltune x':>12s}")
    ours = results["frugaltune"]["useful_tokens"] / results["frugaltune"]["seconds"]
    for recipe, r in results.items():
        rate = r["useful_tokens"] / r["seconds"]
        r.update(useful_tokens_per_s=round(rate, 1), padding=round(1 - r["useful_tokens"] / r["padded_tokens"], 4),
                 mfu=round(rate * per_token / peak, 4), frugaltune_speedup=round(ours / rate, 2))
        label = f"{recipe}{' (bf16)' if r['bf16'] else ' (fp32)'}"
        print(f"{label:28s} {r['steps']:5d} {r['seconds']:8.1f} {rate:12.1f} {r['padding']:8.1%} "
              f"{r['peak_rss_mb']:11.0f} {r['mfu']:6.1%} {r['frugaltune_speedup']:11.2f}x")
    a, b = results["hf_max_length_fp32"], results["hf_group_by_length_bf16"]
    print(f"\nfrugaltune vs (a) HF Trainer, max_length=128, fp32:        {a['frugaltune_speedup']:.2f}x useful tokens/s")
    print(f"frugaltune vs (b) HF Trainer, group_by_length, dynamic, bf16: {b['frugaltune_speedup']:.2f}x useful tokens/s")
    out = Path("reports/benchmarks/train_throughput.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu_peak": formula, "flops_per_token": per_token, "threads": threads,
                               "steps": args.steps, "batch_size": args.batch_size, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
