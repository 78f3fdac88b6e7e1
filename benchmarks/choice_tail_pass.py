"""Constrained choice: the candidates' tail tokens side by side in one forward (tree attention, the default) vs one
cache-copied row per candidate (the implementation before it), same prompts, same model, one run.

    python benchmarks/choice_tail_pass.py                     # 60 scheduling prompts, base model, bf16, batches of 20
    python benchmarks/choice_tail_pass.py --rows 120 --fp32   # more prompts, fp32 weights

Run from the repository root after `make schedule` (it reads scheduling/models/base and scheduling/data/sft.jsonl;
prompts templated with the scheduling params' system message, as the evaluate_policy stage asks them). Everything
but the tail pass is `generation.choose` as shipped (shared prefix read once, prompts batched). Baseline: the tail
pass as it was until this benchmark was written, kept here verbatim as `per_candidate_rows`: the prompts' KV cache
copied to one row per candidate (8 letters: 8 copies of a 200-token cache) and one token forwarded per row.
Contender: `generation._score_tails`. Prints each wall time (best of `--repeats`), the ratio, the time spent in
the tail forwards alone, how many choices agree, and each one's largest score difference from the reference (one
forward over prompt + answer, `--check` prompts): in fp32 both match it to ~1e-5; in bf16 both differ from it by
the same few tenths (rounding of a bf16 model, not of either pass). The CPU and threads are printed with them.
"""

from __future__ import annotations

import argparse
import copy
import time

import common
import torch

from frugaltune import generation
from frugaltune.hardware import cpu_facts


def per_candidate_rows(model, answers, prompt_mask, cache, pad, scores, rows_per_pass: int = 256) -> None:
    """The baseline: the tail pass `generation.choose` had before `_score_tails` (same signature)."""
    rest = [(row, k) for row, options in enumerate(answers) for k in range(len(options)) if len(options[k]) > 1]
    for chunk_start in range(0, len(rest), rows_per_pass):
        chunk = rest[chunk_start:chunk_start + rows_per_pass]
        tail = max(len(answers[row][k]) - 1 for row, k in chunk)
        ids = torch.full((len(chunk), tail), pad, dtype=torch.long)
        tail_mask = torch.zeros((len(chunk), tail), dtype=torch.long)
        for r, (row, k) in enumerate(chunk):
            ids[r, :len(answers[row][k]) - 1] = torch.tensor(answers[row][k][:-1], dtype=torch.long)
            tail_mask[r, :len(answers[row][k]) - 1] = 1
        which = torch.tensor([row for row, _ in chunk])
        rows_cache = copy.deepcopy(cache) if len(rest) > rows_per_pass else cache
        rows_cache.batch_select_indices(which)
        lengths = prompt_mask[which].sum(-1, keepdim=True)
        logits = model(input_ids=ids, attention_mask=torch.cat([prompt_mask[which], tail_mask], dim=1),
                       position_ids=lengths + torch.arange(tail).unsqueeze(0), past_key_values=rows_cache,
                       use_cache=True).logits.float().log_softmax(dim=-1)
        for r, (row, k) in enumerate(chunk):
            targets = answers[row][k][1:]
            scores[row][k] += float(logits[r, torch.arange(len(targets)), torch.tensor(targets)].sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_scheduling_arguments(parser)
    parser.add_argument("--check", type=int, default=8, help="prompts also scored the slow way, as the reference")
    args = parser.parse_args()

    model, tokenizer, prompts, candidates = common.load_scheduling_prompts(args)
    generation.choose(model, tokenizer, prompts[:4], candidates[:4], batch_size=4)  # warm-up

    shipped = generation._score_tails
    tail_seconds: dict[str, float] = {}

    def timed(name, tails):
        def run(*a, **k):
            began = time.perf_counter()
            tails(*a, **k)
            tail_seconds[name] = tail_seconds.get(name, 0.0) + time.perf_counter() - began
        return run

    timings: dict[str, float] = {}
    results: dict[str, tuple[list[int], list[list[float]]]] = {}
    tails_best: dict[str, float] = {}
    try:
        for _ in range(args.repeats):
            for name, tails in (("per-candidate rows", per_candidate_rows), ("side by side", shipped)):
                generation._score_tails = timed(name, tails)
                tail_seconds[name] = 0.0
                began = time.perf_counter()
                results[name] = generation.choose(model, tokenizer, prompts, candidates, batch_size=args.batch_size)
                elapsed = time.perf_counter() - began
                if elapsed < timings.get(name, float("inf")):
                    timings[name], tails_best[name] = elapsed, tail_seconds[name]
    finally:
        generation._score_tails = shipped
    base, new = results["per-candidate rows"], results["side by side"]
    agree = sum(a == b for a, b in zip(base[0], new[0]))
    gap = max(abs(x - y) for a, b in zip(base[1], new[1]) for x, y in zip(a, b))
    print(f"{cpu_facts()['model']}, {torch.get_num_threads()} threads, {'fp32' if args.fp32 else 'bf16'} weights; "
          f"{len(prompts)} prompts of {sum(map(len, prompts)) / len(prompts):.0f} tokens on average, "
          f"{sum(map(len, candidates)) / len(candidates):.1f} candidates each; batches of {args.batch_size}, "
          f"best of {args.repeats}")
    for name in ("per-candidate rows", "side by side"):
        print(f"  {name:20s} {timings[name]:7.2f} s   (tail forwards {tails_best[name]:5.2f} s)"
              f"   {timings['per-candidate rows'] / timings[name]:.2f}x")
    print(f"  same choice on {agree}/{len(prompts)} prompts; largest score difference {gap:.2e}")
    # Which is nearer the truth: each candidate's score from one forward over prompt + answer, for a few prompts
    worst = {name: 0.0 for name in results}
    for e in range(min(args.check, len(prompts))):
        for k, option in enumerate(candidates[e]):
            answer = generation.response_ids(tokenizer, option)
            with torch.inference_mode():
                logprobs = model(input_ids=torch.tensor([prompts[e] + answer])).logits[0].float().log_softmax(-1)
            truth = sum(float(logprobs[len(prompts[e]) - 1 + i, token]) for i, token in enumerate(answer))
            for name, (_, scores) in results.items():
                worst[name] = max(worst[name], abs(scores[e][k] - truth))
    print(f"  largest difference from one forward over prompt + answer ({min(args.check, len(prompts))} prompts): "
          + ", ".join(f"{name} {value:.2e}" for name, value in worst.items()))


if __name__ == "__main__":
    main()
