"""Constrained choice vs free generation + string matching, on the same prompts, in one run.

    python benchmarks/constrained_choice.py                    # SmolLM2-135M (models/base), 120 test tweets
    python benchmarks/constrained_choice.py --rows 300 --adapter models/adapter   # a causal_lm adapter on top

Run from the repository root after `make pipeline` (it reads models/base and data/validated/test.parquet). Each
tweet becomes the prompt of `make sft` (the tweets as prompt -> label word), with the label set as candidates.
Baseline: greedy generation (`--max-new-tokens`, default 4: a label word and EOS), then string matching of the
normalised answer against the candidates. Contender: `frugaltune.generation.choose`, one batched forward over
every (prompt, candidate) row. Prints both wall times and their ratio, how often free generation produced a valid
candidate, and on those rows how often the two agree; the machine's CPU and torch threads are printed with them.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch

from frugaltune import generation
from frugaltune.hardware import cpu_facts
from frugaltune.models import load_for_causal_lm, load_tokenizer

TEMPLATE = ("Is the sentiment of this tweet negative, neutral or positive? Answer with one word. Tweet: {text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=120)
    parser.add_argument("--base", default="models/base")
    parser.add_argument("--adapter", default=None, help="a causal_lm adapter dir to apply (default: the base alone)")
    parser.add_argument("--data", default="data/validated/test.parquet")
    parser.add_argument("--max-new-tokens", type=int, nargs="+", default=[4, 32],
                        help="free generation's limits to time (32: task.max_new_tokens' default)")
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    torch.manual_seed(0)
    tokenizer = load_tokenizer(args.base)
    model = load_for_causal_lm(args.base, tokenizer.pad_token_id, 0)
    if args.adapter:
        from frugaltune.training.methods import load_trained

        model = load_trained(model, Path(args.adapter))
    model.eval()
    frame = pd.read_parquet(args.data)
    labels = sorted(frame["label"].unique())
    frame = frame.sample(n=min(args.rows, len(frame)), random_state=0)  # the file is in corpus order (by label)
    templated = generation.uses_chat_template(tokenizer, "auto")
    prompts = [generation.prompt_ids(tokenizer, TEMPLATE.replace("{text}", text), None, templated)
               for text in frame["text"]]
    candidates = [labels] * len(prompts)

    generation.choose(model, tokenizer, prompts[:2], candidates[:2], batch_size=args.batch_size)  # warm-up
    start = time.perf_counter()
    chosen, _ = generation.choose(model, tokenizer, prompts, candidates, batch_size=args.batch_size)
    choice_s = time.perf_counter() - start
    picked = [labels[i] for i in chosen]
    truth = frame["label"].tolist()
    print(f"CPU: {cpu_facts()['model']}, torch {torch.__version__}, {torch.get_num_threads()} threads, fp32; "
          f"model {args.base}{' + ' + args.adapter if args.adapter else ''}; {len(prompts)} prompts, "
          f"{len(labels)} candidates each, batch {args.batch_size}")
    print("| answered by | seconds | prompts/s | valid answers | accuracy vs label | choice / this |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| constrained choice (each prompt read once, its cache shared by the candidates) | {choice_s:.2f} | "
          f"{len(prompts) / choice_s:.1f} | {len(prompts)}/{len(prompts)} | "
          f"{sum(p == t for p, t in zip(picked, truth)) / len(truth):.3f} | 1.0x |")
    allowed = {generation.normalize_answer(label): label for label in labels}
    agreement = []
    for limit in args.max_new_tokens:
        start = time.perf_counter()
        free = generation.generate(model, tokenizer, prompts, limit, batch_size=args.batch_size)
        free_s = time.perf_counter() - start
        matched = [allowed.get(generation.normalize_answer(answer)) for answer in free]
        valid = [i for i, m in enumerate(matched) if m is not None]
        exact = [i for i, answer in enumerate(free) if answer in labels]  # the very candidate string
        print(f"| free generation (up to {limit} new tokens) + string match | {free_s:.2f} | "
              f"{len(prompts) / free_s:.1f} | {len(valid)}/{len(prompts)} | "
              f"{sum(m == t for m, t in zip(matched, truth)) / len(truth):.3f} | {free_s / choice_s:.1f}x |")
        agreement.append(f"up to {limit} tokens: agree on {sum(free[i] == picked[i] for i in exact)} of the "
                         f"{len(exact)} answers that are a candidate as written, on "
                         f"{sum(matched[i] == picked[i] for i in valid)} of the {len(valid)} that match one after "
                         "normalising (case, spaces, punctuation)")
    print("Free generation vs constrained choice: " + "; ".join(agreement))


if __name__ == "__main__":
    main()
