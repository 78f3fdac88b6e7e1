"""Training throughput: frugaltune's LoRA training against two Hugging Face `Trainer` recipes, and each of its speed
switches against the previous default, in one run.

    python benchmarks/train_throughput.py                  # the pipeline's model + data: 20 warm-up + 20 timed steps
    python benchmarks/train_throughput.py --methods lora,qlora,dora --rounds 2
    python benchmarks/train_throughput.py --steps 10 --batch-size 8 --warmup 0   # time from the first step
    python benchmarks/train_throughput.py --model SmolLM2-1.7B --recipes frugaltune,b --warmup 2 --steps 6
    python benchmarks/train_throughput.py --against v0.1.0 --recipes frugaltune --rounds 3   # `make bench-check`
    python benchmarks/train_throughput.py --recipes frugaltune,b --targets params   # the train stage's adapter

On a machine where torch drives a CUDA GPU every recipe trains on it (the Trainer recipes without `use_cpu`), the
precision is the planner's (bf16 from compute capability 8.0), attention is SDPA, the measured peak is torch.matmul
on the GPU at the model's shapes and the nominal one the tensor-core (bf16) or CUDA-core (fp32) peak of
frugaltune.kernels.cuda.device_peaks at the boost clock; peak GPU memory is printed beside peak RSS.

Needs `models/base` and `data/tokenized` (run `make pipeline`, or `dvc repro tokenize`). Every recipe trains the
same adapter (peft, r=8 on q/k/v/o or on `--targets`, dropout 0.05, the seeded classification head) on the same sequences ((warmup +
steps) x batch-size rows sampled across the training split with seed 42 and wrapped in `train.input_template` as the
train stage wraps them; one pass), with AdamW at the same rate, on the same threads. The first `--warmup` steps
(20) of every recipe are not timed: a process's first steps pay one-off costs (torch.compile's compilation of the
int8 steps, 1-10 s over the first two steps on a Zen 5 depending on inductor's cache; oneDNN's first call at each
new batch shape), which the pipeline's 178 steps amortize. The whole runs' rates, warm-up included, are printed
beside.

- frugaltune: `frugaltune.training.loop.train_classifier` as `dvc repro train` runs it: length-grouped batches,
  dynamic padding, the plan's precision (frugaltune.resolve: what the kernels stage measured), and the speed
  switches of `frugaltune.training.fast`
  (LoRA dropout from fewer random words, shared by q/k/v; eager attention up to the measured crossover length;
  frozen weights stored in bf16 when bf16 was measured faster; AdamW as one fused kernel; the frozen products in
  int8 where the plan decided them for the method (`train.int8_products`), as in the train stage: frugaltune/int8.py);
- frugaltune, switches off: the same loop with peft's `nn.Dropout`, SDPA attention, fp32 frozen weights and torch's
  default AdamW (the default before the switches);
- (a) the common recipe: HF `Trainer` + peft, `padding="max_length", max_length=128`, fp32;
- (b) a tuned HF `Trainer`: `train_sampling_strategy="group_by_length"`, dynamic padding (`DataCollatorWithPadding`),
  in the precision a tuned user picks on this machine: bf16 autocast where the plan measured bf16 faster than fp32,
  else fp32 (on a CPU without fast bf16, autocast to bf16 runs several times slower than fp32).
`--methods` adds QLoRA and DoRA (frugaltune with and without the switches; the Trainer recipes are LoRA's);
`--recipes` runs some of them (frugaltune always); `--model` trains a larger model than models/base: a model
directory, or a shape of frugaltune/assets/shapes with random weights (its time and memory are a real checkpoint's),
on the project's rows and tokenizer.

Each recipe runs in its own subprocess, so its peak RSS is its own. The frugaltune recipes run on the allocator the
train stage runs on (`train.allocator`: mimalloc where installed, frugaltune.allocator), the Trainer recipes on the
system's, as their users get it (`--allocator system`: every recipe on the system's). With `--rounds N` the recipes
run round-robin N times and each reports its median, so a slow spell of a shared machine does not land on one recipe.
Reported per recipe: useful (non-pad) tokens/s over the timed steps (model loading and the warm-up excluded, for
all alike; over the whole run beside it), the padding share, peak RSS, and MFU = useful-token FLOPs/s / peak, where

    FLOPs per useful token = 4 N + 12 L s h   (N: matmul parameters; LoRA trains no base weight, so backward is
                                               one input-gradient pass, 2N, on top of the 2N forward; attention:
                                               4 L s h forward for QK^T and AV, x3 with backward; s: mean length)
    measured peak = the best of torch.matmul at the model's shapes (tokens x hidden x {hidden, intermediate} and
                    back) in the recipe's precision, on the same threads, measured in this run;
                    (int8's, torch._int_mm, for a run whose frozen products ran in int8; its MFU against the
                    bf16 peak, what recipe (b) is charged against, is printed beside it);
    nominal peak  = cores x clock x fp32 FLOPs/cycle (frugaltune.hardware.cpu_peak_flops), printed beside it.

Padded tokens are computed but not useful: MFU over useful tokens charges padding to the recipe that adds it.

`--against REV` (`make bench-check`, the guard against a silent regression): the frugaltune recipes of git revision
REV (`latest-tag`: the last release tag) too, alternated with this tree's round by round: REV's files (`git
archive`) in a temporary directory, its own benchmark script, library and params.yaml run in the child there, on
this checkout's model, rows and plan (models/, data/, reports/ linked), so only the code differs. Prints this tree
over REV for each method (medians) and exits 1 when this tree is more than `--tolerance` (5 %) slower at any of them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
from common import BASE, LABELS_FILE, TOKENIZED

from frugaltune import allocator
from frugaltune.config import load_params

# --recipes: frugaltune with and without its speed switches, the common Trainer recipe (a), the tuned one (b)
HF_RECIPES = {"a": "hf_max_length_fp32", "b": "hf_group_by_length"}
KINDS = ("frugaltune", "frugaltune-off", *HF_RECIPES)


def checkout(rev: str, into: Path) -> str:
    """REV's files (git archive) under `into`, and the commit they are; `latest-tag`: the last release tag."""
    def git(*args: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(common.ROOT), *args], capture_output=True, check=False, **kwargs)

    if rev == "latest-tag":
        found = git("describe", "--tags", "--abbrev=0", text=True)
        if found.returncode != 0:
            sys.exit("--against latest-tag: this repository has no release tag; tag one (`git tag v0.1.0 <commit>`) "
                     "or name a revision (`make bench-check BASE=<commit>`)")
        rev = found.stdout.strip()
    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}", text=True)
    if commit.returncode != 0:
        sys.exit(f"--against {rev}: not a revision of this repository ({commit.stderr.strip()})")
    archive = git("archive", "--format=tar", commit.stdout.strip())
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    # REV runs in its own tree with its own params.yaml (an older REV cannot parse today's keys) on this checkout's
    # model, rows and plan: those three directories are links to this checkout's
    for shared in ("models", "data", "reports"):
        if (into / shared).is_dir():
            shutil.rmtree(into / shared)
        (into / shared).symlink_to(common.ROOT / shared)
    return f"{rev} ({commit.stdout.strip()[:8]})"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run_recipe(recipe: str, steps: int, batch_size: int, lr: float, threads: int, bf16_ours: bool,
               eager_max: int, warmup: int = 0, model_dir: Path = BASE, targets: tuple[str, ...] = ()) -> dict:
    """One recipe on (warmup + steps) x batch_size rows; the last `steps` steps are timed ("cold_": the whole run).
    `targets`: the adapted layers (empty: MethodKnobs' q/k/v/o)."""
    import torch

    from frugaltune.planner.memory import MethodKnobs

    knobs = MethodKnobs(target_modules=targets) if targets else None

    torch.set_num_threads(threads)
    ids, labels = common.training_examples((warmup + steps) * batch_size)
    useful = sum(len(x) for x in ids)
    if recipe.startswith("frugaltune"):  # frugaltune[-off]:<method>
        from frugaltune.training.loop import train_classifier
        from frugaltune.training.loop_config import LoopConfig

        kind, method = recipe.split(":")
        switches = kind == "frugaltune"
        if switches:  # on a GPU, SDPA without cuDNN (planner.machine.keep_sdpa_off_cudnn, as the train stage does)
            from frugaltune.planner.machine import keep_sdpa_off_cudnn

            keep_sdpa_off_cudnn()
        model, tokenizer = common.lora_model(bf16_ours, method, switches, knobs=knobs, model_dir=model_dir)
        int8_products = {"on": False}
        if switches:  # the plan's int8 decision for the method (train.int8_products), carried out as the train stage
            from frugaltune import methods
            from frugaltune.training.setup import apply_int8

            int8_products = apply_int8(model, common.machine(method=method, int8=True)["int8"], methods.get(method))
        cfg = LoopConfig.build(lr=lr, head_lr=2 * lr, batch_size=batch_size, epochs=1, seed=42, bf16=bf16_ours,
                               log_every=1, eager_attention_max_len=eager_max if switches else 0,
                               fused_optimizer=switches, fused_int8_lora=switches)
        # One record per step: its end (elapsed_s) and its useful tokens/s, from which its tokens follow (the loop's
        # records carry no token count, and frugaltune/training is part of every federation's run key).
        records: list[dict] = []
        result = train_classifier(model, ids, labels, cfg, tokenizer.pad_token_id, progress=False,
                                  on_log=records.append)
        ends = [0.0] + [r["elapsed_s"] for r in records]
        step_tokens = [round(r["tokens_per_s"] * (ends[i + 1] - ends[i])) for i, r in enumerate(records)]
        return {"seconds": ends[-1] - ends[warmup], "useful_tokens": sum(step_tokens[warmup:]),
                "steps": len(records) - warmup, "cold_seconds": result.wall_seconds,
                "cold_useful_tokens": result.tokens, "padded_tokens": result.padded_tokens, **common.peak_memory(),
                "bf16": bf16_ours, "final_loss": result.final_loss, "allocator": allocator.active(),
                "int8_products": int8_products, "events": result.events}

    from datasets import Dataset
    from transformers import DataCollatorWithPadding, Trainer, TrainerCallback, TrainingArguments

    max_length = recipe == "hf_max_length_fp32"
    bf16 = bf16_ours and not max_length  # (b) as a tuned user picks it: the precision that is faster on this machine
    model, tokenizer = common.lora_model(False, knobs=knobs, model_dir=model_dir)
    if max_length:  # the common recipe: every sequence padded to 128 when tokenized
        pad = tokenizer.pad_token_id
        rows = {"input_ids": [x + [pad] * (128 - len(x)) for x in ids],
                "attention_mask": [[1] * len(x) + [0] * (128 - len(x)) for x in ids], "labels": labels}
        collator = None
    else:
        rows = {"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids], "labels": labels}
        collator = DataCollatorWithPadding(tokenizer)
    dataset = Dataset.from_dict(rows)
    padded = {"tokens": 0, "timed_useful": 0}

    class Clock(TrainerCallback):  # times the training steps only, as for frugaltune: the end of the warm-up's
        def on_train_begin(self, args, state, control, **kwargs):  # last step to the end of the last step
            padded["start"] = padded["warm"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            padded["end"] = time.perf_counter()
            if state.global_step == warmup:
                padded["warm"] = padded["end"]

    class CountingTrainer(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            padded["tokens"] += int(inputs["input_ids"].numel())
            if self.state.global_step >= warmup:  # global_step counts the steps finished before this one
                padded["timed_useful"] += int(inputs["attention_mask"].sum())
            return super().compute_loss(model, inputs, *args, **kwargs)

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=batch_size, num_train_epochs=1, learning_rate=lr,
            lr_scheduler_type="linear", warmup_steps=0.05,  # a float < 1: a ratio (transformers 5)
            weight_decay=0.0, max_grad_norm=1.0, seed=42,
            use_cpu=not _cuda(), bf16=bf16, save_strategy="no", report_to="none", logging_steps=steps,
            disable_tqdm=True, dataloader_num_workers=0,
            train_sampling_strategy="group_by_length" if not max_length else "random",
        )
        trainer = CountingTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                                  callbacks=[Clock()])
        state = trainer.train()
    return {"seconds": padded["end"] - padded["warm"], "useful_tokens": padded["timed_useful"],
            "steps": state.global_step - warmup, "cold_seconds": padded["end"] - padded["start"],
            "cold_useful_tokens": useful, "padded_tokens": padded["tokens"], **common.peak_memory(), "bf16": bf16,
            "allocator": allocator.active()}


def measured_peaks(threads: int, model_dir: Path, precisions: set[str], tokens: int = 2048,
                   repeats: int = 5) -> dict[str, float]:
    """FLOP/s of torch.matmul at the model's layer shapes, per precision of `precisions` (fp32, bf16, int8): the
    best of `repeats` over all shapes. The peak a training run could reach on these threads if it did nothing but
    its matmuls. Only the precisions a recipe runs in are timed: on a CPU without fast bf16 or int8 their products
    run a hundred times slower than fp32's, minutes at a 1.7 B model's shapes."""
    import time as _time

    import torch
    from transformers import AutoConfig

    torch.set_num_threads(threads)
    config = AutoConfig.from_pretrained(str(model_dir))
    h, i = config.hidden_size, config.intermediate_size
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # A GPU finishes one such product in microseconds: time 50 back to back between synchronizations.
    calls = 50 if device == "cuda" else 1
    peaks = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if name not in precisions:
            continue
        best = 0.0
        for k, n in ((h, h), (h, i), (i, h)):
            a, b = torch.randn(tokens, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
            torch.matmul(a, b)
            for _ in range(repeats):
                if device == "cuda":
                    torch.cuda.synchronize()
                start = _time.perf_counter()
                for _ in range(calls):
                    torch.matmul(a, b)
                if device == "cuda":
                    torch.cuda.synchronize()
                best = max(best, 2 * tokens * k * n * calls / (_time.perf_counter() - start))
        peaks[name] = best
    if "int8" in precisions and device == "cpu" and hasattr(torch, "_int_mm"):  # the int8 products' own peak
        best = 0.0
        for k, n in ((h, h), (h, i), (i, h)):
            a = torch.randint(-127, 128, (tokens, k), dtype=torch.int8)
            b = torch.randint(-127, 128, (n, k), dtype=torch.int8).t()  # the layout frugaltune/int8.py multiplies
            torch._int_mm(a, b)
            for _ in range(repeats):
                start = _time.perf_counter()
                torch._int_mm(a, b)
                best = max(best, 2 * tokens * k * n / (_time.perf_counter() - start))
        peaks["int8"] = best
    return peaks


def gpu_peak_flops(bf16: bool) -> tuple[float, str]:
    """The nominal peak of this GPU in the run's precision: bf16 on tensor cores, fp32 on CUDA cores (no TF32)."""
    import torch

    from frugaltune.kernels.cuda import device_peaks

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    clock = max(getattr(props, "clock_rate", 0) / 1000, _nvml_max_clock())
    peaks = device_peaks((props.major, props.minor), props.multi_processor_count, clock, props.name)
    key = "fp16_tensor_tflops" if bf16 else "fp32_tflops"
    return peaks[key] * 1e12, f"{props.name}: {props.multi_processor_count} SMs x {clock:.0f} MHz, {key} {peaks[key]}"


def _nvml_max_clock() -> float:
    from frugaltune.hardware import nvml_gpus

    gpus, _, _ = nvml_gpus()
    return max((g.get("max_sm_clock_mhz") or 0 for g in gpus), default=0)


def flops_per_token(mean_length: float, model_dir: Path) -> float:
    from transformers import AutoConfig

    from frugaltune.planner.memory import model_shape

    config = AutoConfig.from_pretrained(str(model_dir))
    shape = model_shape(model_dir, len(common.labels()), "lora")
    return 4 * shape.matmul_params + 12 * config.num_hidden_layers * mean_length * config.hidden_size


def torch_device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def main() -> None:
    import statistics

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per recipe")
    parser.add_argument("--warmup", type=int, default=20,
                        help="untimed steps before them, alike for every recipe (compilation, oneDNN's first calls "
                        "at each new shape); 0: time from the first step")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=None, help="default: physical cores")
    parser.add_argument("--methods", default="lora", help="comma-separated: lora, qlora, dora")
    parser.add_argument("--rounds", type=int, default=1, help="run every recipe this many times, round-robin")
    parser.add_argument("--allocator", choices=["train", "system"], default="train",
                        help="train: the frugaltune recipes on train.allocator (as the train stage); system: all on "
                        "the system's malloc")
    parser.add_argument("--model", metavar="NAME|DIR", help="train this model instead of models/base: a model "
                        "directory, or a shape's name (frugaltune/assets/shapes: random weights of its shape, written "
                        "once into .cache/shapes)")
    parser.add_argument("--recipes", default=",".join(KINDS), help=f"comma-separated, of: {', '.join(KINDS)}")
    parser.add_argument("--against", metavar="REV", help="also the frugaltune recipes of git revision REV "
                        "(latest-tag: the last release tag), alternated; exit 1 when this tree is slower than REV by "
                        "more than --tolerance")
    parser.add_argument("--tolerance", type=float, default=0.05, help="--against: the slowdown allowed (0.05 = 5 %%)")
    parser.add_argument("--targets", default="", help="LoRA's adapted layers, comma-separated, for every recipe: "
                        "default q/k/v/o (the reference of the figures in docs/BENCHMARKS.md); `params`: "
                        "train.lora.target_modules, what `dvc repro train` trains (not with --against a revision "
                        "older than this option)")
    parser.add_argument("--recipe", help=argparse.SUPPRESS)  # a child process: one recipe
    parser.add_argument("--model-dir", type=Path, default=BASE, help=argparse.SUPPRESS)
    parser.add_argument("--bf16-ours", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--eager-max", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()

    from frugaltune.hardware import cpu_peak_flops, probe

    cuda = _cuda()
    hw = probe(use_nvml=cuda)
    threads = args.threads or common.machine()["threads"]  # the plan's, as the train stage reads them
    if args.recipe:
        targets = tuple(t for t in args.targets.split(",") if t)
        print(json.dumps(run_recipe(args.recipe, args.steps, args.batch_size, args.lr, threads, args.bf16_ours,
                                    args.eager_max, args.warmup, args.model_dir, targets)))
        return
    common.require(BASE, TOKENIZED, LABELS_FILE, fix="run `make pipeline` (or `dvc repro tokenize`) first")
    decided = common.machine()  # the plan's precision and attention crossover, as the train stage reads them
    bf16_ours, why, eager_max = decided["bf16"], decided["precision_why"], decided["eager_attention_max_len"]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    kinds = [k.strip() for k in args.recipes.split(",") if k.strip()]
    if "frugaltune" not in kinds or set(kinds) - set(KINDS):
        parser.error(f"--recipes: of {', '.join(KINDS)}, frugaltune among them (the others are compared with it)")
    model_dir = common.model_dir(args.model)
    if args.targets == "params":
        args.targets = ",".join(load_params().train.lora.target_modules)
    recipes = ([f"{kind}:{m}" for m in methods for kind in ("frugaltune", "frugaltune-off") if kind in kinds]
               + [recipe for kind, recipe in HF_RECIPES.items() if kind in kinds])
    nominal, formula = gpu_peak_flops(bf16_ours) if cuda else cpu_peak_flops(hw, threads)
    # the precisions the recipes run in: fp32 always (recipe (a)'s, and the nominal peak's), bf16 where the plan
    # trains in it, int8 where the plan decided int8 products for a method
    precisions = {"fp32"} | ({"bf16"} if bf16_ours else set()) | (
        {"int8"} if any(common.machine(method=m, int8=True)["int8"]["on"] for m in methods) else set())
    peaks = measured_peaks(threads, model_dir, precisions)
    ours_on = load_params().train.allocator if args.allocator == "train" else "system"
    baseline_dir = tempfile.TemporaryDirectory(prefix="frugaltune-against-") if args.against else None
    against = checkout(args.against, Path(baseline_dir.name)) if baseline_dir else None
    if against:  # REV's frugaltune recipes, each right after this tree's (the same method, the same round)
        recipes = [r for recipe in recipes for r in ([recipe, recipe.replace("frugaltune:", "frugaltune@REV:")]
                                                     if recipe.startswith("frugaltune:") else [recipe])]
    runs: dict[str, list[dict]] = {r: [] for r in recipes}
    for round_ in range(args.rounds):
        for recipe in recipes:
            # each tree's own library, whichever checkout the venv's editable install points at
            script, env_extra, cwd = __file__, {"PYTHONPATH": str(common.ROOT)}, None
            if "@REV:" in recipe:  # REV's own script, library and params, on this checkout's files (checkout())
                script = str(Path(baseline_dir.name) / "benchmarks" / Path(__file__).name)
                env_extra, cwd = {"PYTHONPATH": baseline_dir.name}, baseline_dir.name
            cmd = [sys.executable, script, "--recipe", recipe.replace("@REV", ""), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--batch-size",
                   str(args.batch_size), "--lr", str(args.lr), "--threads", str(threads),
                   "--eager-max", str(eager_max)] + (["--bf16-ours"] if bf16_ours else [])
            if model_dir != BASE:  # named only when asked: a REV older than --model does not know the flag
                cmd += ["--model-dir", str(Path(model_dir).resolve())]
            if args.targets:  # likewise
                cmd += ["--targets", args.targets]
            print(f"round {round_ + 1}/{args.rounds}: {recipe.replace('REV', against or '')} ...", flush=True)
            env = {**allocator.child_env(ours_on if recipe.startswith("frugaltune") else "system"), **env_extra}
            runs[recipe].append(common.run_child(cmd, recipe, env, cwd=cwd))
    if baseline_dir:
        baseline_dir.cleanup()
    after = measured_peaks(threads, model_dir, precisions)
    peaks = {k: max(v, after[k]) for k, v in peaks.items()}  # the best of before and after the recipes
    results = {}
    for recipe, rs in runs.items():
        rates = [r["useful_tokens"] / r["seconds"] for r in rs]
        median = sorted(rs, key=lambda r: r["useful_tokens"] / r["seconds"])[len(rs) // 2]
        cold = [r["cold_useful_tokens"] / r["cold_seconds"] for r in rs]
        results[recipe] = {**median, "rates": [round(x, 1) for x in rates], "rate": statistics.median(rates),
                           "cold_rate": statistics.median(cold)}

    ids, _ = common.training_examples((args.warmup + args.steps) * args.batch_size)
    per_token = flops_per_token(sum(len(x) for x in ids) / len(ids), model_dir)
    where = f"GPU {torch_device_name()}, " if cuda else ""
    print(f"\nr=8 adapters on {args.targets.replace(',', '/') or 'q/k/v/o'} of {args.model or BASE}{' (random weights of its shape)' if model_dir != BASE else ''}, {(args.warmup + args.steps) * args.batch_size} training sequences (one pass, "
          f"batch {args.batch_size}; {args.warmup} warm-up steps, then {args.steps} timed), {where}{threads} threads, "
          f"{args.rounds} round(s) (median), CPU {common.cpu_label(hw)}.")
    print(f"frugaltune precision: {'bf16' if bf16_ours else 'fp32'} ({why}); eager attention up to {eager_max} "
          f"tokens (kernels stage)")
    print(f"Measured matmul peak on {threads} threads: "
          + ", ".join(f"{name} {peak / 1e9:.0f} {'GOP' if name == 'int8' else 'GFLOP'}/s" for name, peak in peaks.items())
          + f". Nominal: {formula}.")
    print(f"FLOPs per useful token: 4N + 12 L s h = {per_token / 1e6:.0f} MFLOP (LoRA; DoRA and QLoRA do more "
          "per token: their MFU is counted on the same FLOPs)\n")
    print(f"{'recipe':44s} {'steps':>5s} {'seconds':>8s} {'useful tok/s':>12s} {'padding':>8s} {'peak RSS MB':>11s} "
          f"{'MFU meas.':>9s} {'MFU nom.':>8s} {'frugaltune x':>12s} {'whole run tok/s':>15s}")
    ours = results[f"frugaltune:{methods[0]}"]["rate"]
    for recipe, r in results.items():
        rate = r["rate"]
        # The peak of the precision the products ran in: int8's where the frozen products ran in int8.
        peak = peaks["int8" if r.get("int8_products", {}).get("on") else "bf16" if r["bf16"] else "fp32"]
        reference = results.get(f"frugaltune:{recipe.split(':')[1]}", {}).get("rate", ours) if ":" in recipe else ours
        r.update(useful_tokens_per_s=round(rate, 1), padding=round(1 - r["cold_useful_tokens"] / r["padded_tokens"], 4),
                 mfu_measured_peak=round(rate * per_token / peak, 4), mfu_nominal=round(rate * per_token / nominal, 4),
                 frugaltune_speedup=round(reference / rate, 2))
        products = "int8+bf16" if r.get("int8_products", {}).get("on") else "bf16" if r["bf16"] else "fp32"
        label = f"{recipe} ({products}, {r['allocator']})"
        print(f"{label:44s} {r['steps']:5d} {r['seconds']:8.1f} {rate:12.1f} {r['padding']:8.1%} "
              f"{r['peak_rss_mb']:11.0f} {r['mfu_measured_peak']:9.1%} {r['mfu_nominal']:8.1%} "
              f"{r['frugaltune_speedup']:11.2f}x {r['cold_rate']:15.1f}"
              + (f"  GPU peak {r['cuda_peak_allocated_mb']:.0f} MB" if "cuda_peak_allocated_mb" in r else ""))
    print()
    cold = results[f"frugaltune:{methods[0]}"]["cold_rate"]
    for name, recipe, what in (("a", "hf_max_length_fp32", "max_length=128, fp32"),
                               ("b", "hf_group_by_length", "group_by_length, dynamic, "
                                + ("bf16" if bf16_ours else "fp32"))):
        if recipe in results:
            r = results[recipe]
            print(f"frugaltune vs ({name}) HF Trainer, {what}: {r['frugaltune_speedup']:.2f}x useful tokens/s"
                  + (f" ({cold / r['cold_rate']:.2f}x over the whole runs, the {args.warmup} warm-up steps included)"
                     if args.warmup else ""))
    for m in methods:
        if f"frugaltune-off:{m}" not in results:
            continue
        on, off = results[f"frugaltune:{m}"]["rate"], results[f"frugaltune-off:{m}"]["rate"]
        print(f"{m}: speed switches on vs off: {on / off:.2f}x useful tokens/s")
        int8_products = results[f"frugaltune:{m}"].get("int8_products", {})
        if int8_products.get("on"):  # the same run charged against the bf16 peak, as recipe (b) is
            bf16_mfu = on * per_token / peaks["bf16" if bf16_ours else "fp32"]
            print(f"{m}: int8 products ({int8_products['why']}): MFU {bf16_mfu:.1%} of the measured "
                  f"{'bf16' if bf16_ours else 'fp32'} peak, {on * per_token / peaks['int8']:.1%} of the int8 peak")
    slower = []
    for m in methods if against else []:
        ratio = results[f"frugaltune:{m}"]["rate"] / results[f"frugaltune@REV:{m}"]["rate"]
        print(f"{m}: this tree over {against}: {ratio:.3f}x useful tokens/s (medians of {args.rounds} alternated "
              f"rounds: {results[f'frugaltune:{m}']['rates']} against {results[f'frugaltune@REV:{m}']['rates']})")
        if ratio < 1 - args.tolerance:
            slower.append(f"{m} {1 - ratio:.1%} slower")
    common.write_results("train_throughput", {
        "cpu": common.cpu_label(hw), "model": str(args.model or BASE), "lora_targets": args.targets or "q_proj,k_proj,v_proj,o_proj", "gpu": torch_device_name() if cuda else None, "nominal_peak": formula,
        "nominal_peak_flops": nominal, "measured_peak_flops": peaks, "flops_per_token": per_token, "threads": threads,
        "steps": args.steps, "warmup": args.warmup, "batch_size": args.batch_size, "rounds": args.rounds,
        "precision": "bf16" if bf16_ours else "fp32", "eager_attention_max_len": eager_max, "results": results,
        "against": against})
    if slower:
        sys.exit(f"bench-check: this tree is slower than {against} by more than {args.tolerance:.0%}: "
                 f"{', '.join(slower)}. Find the commit with `git bisect` and this benchmark (docs/BENCHMARKS.md).")


if __name__ == "__main__":
    main()
