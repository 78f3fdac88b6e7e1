"""causal_lm training with the batch's shared prompt prefix read once, against every row read in full, in one run.

    python benchmarks/shared_prefix_training.py                       # 12 steps of 16 tweets, `make sft`'s prompt
    python benchmarks/shared_prefix_training.py --steps 20 --precision fp32 --target-modules q_proj v_proj

Run from the repository root after `make pipeline` (it reads models/base and data/validated/train.parquet). Each
tweet becomes `make sft`'s prompt (chat template, default system turn, the instruction) with its label word as
the response: the rows of a batch share the system turn and the instruction, about half their tokens. Both
variants train the same LoRA from the same seed on the same batches through `frugaltune.training.loop`
(`train_classifier`, length-grouped): the baseline with `shared_prefix_min=0` (each row computes its whole
prompt), the contender with the default (the shared prefix runs once per batch and its keys/values are repeated).
They run alternately, twice each, and the faster of each pair's steady state (steps after the first two) is kept.
Printed: useful tokens/s, the shared tokens per batch, the mean loss of each (the same up to rounding and LoRA
dropout's masks on the shared part), and the ratio; the CPU and precision are printed with them.
"""

from __future__ import annotations

import argparse

import common
import pandas as pd
import torch

from frugaltune import generation
from frugaltune.hardware import cpu_facts
from frugaltune.planner import MethodKnobs
from frugaltune.training.batching import IGNORE_INDEX
from frugaltune.training.loop import LoopConfig, train_classifier
from frugaltune.training.methods import prepare_model

TEMPLATE = "Is the sentiment of this tweet negative, neutral or positive? Answer with one word. Tweet: {text}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--base", default="models/base")
    parser.add_argument("--data", default="data/validated/train.parquet")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default=None, 
                        help="default: the plan's (frugaltune.resolve)")
    parser.add_argument("--target-modules", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj"])
    args = parser.parse_args()
    # the plan's precision and attention crossover (the kernels stage measured both), or --precision's crossover
    decided = common.machine(args.precision or "auto")
    precision = "bf16" if decided["bf16"] else "fp32"

    from frugaltune.models import load_tokenizer

    tokenizer = load_tokenizer(args.base)
    templated = generation.uses_chat_template(tokenizer, "auto")
    frame = pd.read_parquet(args.data).sample(n=args.steps * args.batch, random_state=0)
    ids, labels = [], []
    for text, label in zip(frame["text"], frame["label"]):
        prompt = generation.prompt_ids(tokenizer, TEMPLATE.replace("{text}", text), None, templated)
        response = generation.response_ids(tokenizer, str(label))
        ids.append(prompt + response)
        labels.append([IGNORE_INDEX] * len(prompt) + response)

    def run(share_from: int) -> dict:
        model = prepare_model(args.base, [], tokenizer.pad_token_id, 42, "lora",
                              MethodKnobs(target_modules=tuple(args.target_modules)), bf16=precision == "bf16",
                              task="causal_lm")
        cfg = LoopConfig(lr=1e-3, batch_size=args.batch, epochs=1, seed=42, log_every=1, bf16=precision == "bf16",
                         eager_attention_max_len=decided["eager_attention_max_len"], shared_prefix_min=share_from)
        result = train_classifier(model, ids, labels, cfg, tokenizer.pad_token_id, progress=False)
        # log_every=1: each record is one step, its tokens = its rate x its duration
        ends = [h["elapsed_s"] for h in result.history]
        seconds = [end - start for start, end in zip([0.0] + ends, ends)]
        tokens = [h["tokens_per_s"] * s for h, s in zip(result.history, seconds)]
        return {"tokens_per_s": sum(tokens[2:]) / sum(seconds[2:]), "mean_loss": result.mean_loss,
                "shared": result.shared_prefix_tokens / result.steps, "tokens": result.tokens / result.steps}

    results = {"every row in full": [], "shared prefix once": []}
    for _ in range(2):
        results["every row in full"].append(run(0))
        results["shared prefix once"].append(run(LoopConfig.shared_prefix_min))
    best = {name: max(runs, key=lambda r: r["tokens_per_s"]) for name, runs in results.items()}
    base = best["every row in full"]["tokens_per_s"]
    print(f"CPU: {cpu_facts()['model']}, torch {torch.__version__}, {torch.get_num_threads()} threads, {precision}; "
          f"LoRA r=8 on {', '.join(args.target_modules)}; {args.steps} steps of {args.batch} tweets, "
          f"{best['every row in full']['tokens']:.0f} useful tokens per step")
    print("| variant | useful tok/s (steady, best of 2) | shared tokens not recomputed per step | mean loss | vs full |")
    print("|---|---:|---:|---:|---:|")
    for name, r in best.items():
        print(f"| {name} | {r['tokens_per_s']:.1f} | {r['shared']:.0f} | {r['mean_loss']:.4f} | "
              f"{r['tokens_per_s'] / base:.2f}x |")


if __name__ == "__main__":
    main()
