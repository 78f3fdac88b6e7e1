"""LoRA's frozen base products in int8 (the CPU's VNNI dot products) against bf16: a lever for issue 12, measured.

    python benchmarks/int8_products.py                         # GEMMs, numerics, loop A/B (3 rounds): ~4 min
    python benchmarks/int8_products.py --ab-rounds 5 --ab-steps 12
    python benchmarks/int8_products.py --method dora          # or qlora: that method's numerics and loop
    python benchmarks/int8_products.py --quality NAME [key=value ...]   # through the train + evaluate stages

Under LoRA the base weights never change, so every product with them (q/k/v/o and the MLP's gate/up/down, forward
and the input gradient of backward) can run on int8 operands (frugaltune/int8.py says how). AVX512-VNNI multiplies
int8 at twice bf16's rate per instruction, and `torch._int_mm` reaches that on this kind of CPU.

Four parts, on this machine's threads:
1. GEMMs at the model's shapes: fp32, bf16 and int8 (`torch._int_mm`) GFLOP/s (int8: GOP/s), one table.
2. Numerics on one batch of 16 training rows (dropout off): the relative error of the logits and of every LoRA
   gradient against fp32, for bf16 autocast (the default) and for int8 products.
3. `--ab-rounds N` (default 3): the project's loop (`train_classifier`) with bf16 products against int8 products,
   two models on the same slices, alternated, round 0 a warm-up (it includes the compilation).
4. `--quality NAME [overrides]`: `benchmarks/quality_sweep.py NAME train.int8_products=true [overrides]` (the
   train stage itself, then the evaluate stage on the bf16 base, as serving loads the adapter); the row lands in
   reports/sweep/quality_sweep.jsonl.

`--method dora|qlora` runs parts 2-3 on that method as the train stage builds it (DoRA keeps its bf16 weights for
its norm; QLoRA's int8 copies are made from its dequantized NF4 blocks, and the 4-bit weights are dropped).
The train stage's switch is `train.int8_products` (DECISIONS, "int8 products"). Results of parts 1-3 go to
reports/benchmarks/int8_products.json (int8_products_<method>.json for DoRA and QLoRA). Needs `models/base` and
`data/tokenized` (`make pipeline`).
"""

from __future__ import annotations

if __name__ == "__main__":
    from frugaltune import allocator as _allocator

    _allocator.reexec_early()  # the train stage's malloc (mimalloc where installed), as quality_sweep runs

import argparse
import json
import statistics
import sys
import time

import common
import torch
from common import alternated, loop_round, timed

from frugaltune.hardware import cpu_facts
from frugaltune.int8 import apply, status


def to_int8(model, method: str) -> None:
    """As the train stage does for `method` (DoRA keeps its weights; QLoRA's copies come from its NF4 blocks), on
    whatever the plan decided: the int8 variant of the A/B."""
    apply(model, common.forced_int8(True), method)


def gemm_table(rows: int, hidden: int, mlp: int) -> list[dict]:
    table = []
    for m, k, n in [(rows, hidden, hidden), (rows, hidden, mlp), (rows, mlp, hidden)]:
        a, b = torch.randn(m, k), torch.randn(k, n)
        ai = torch.randint(-127, 128, (m, k), dtype=torch.int8)
        bi = torch.randint(-127, 128, (n, k), dtype=torch.int8).t()  # the layout the module multiplies by
        flops = 2 * m * k * n
        a16, b16 = a.bfloat16(), b.bfloat16()
        row = {"shape": f"{m}x{k}x{n}", "fp32": flops / timed(lambda: a @ b, 30) / 1e9,
               "bf16": flops / timed(lambda: a16 @ b16, 30) / 1e9,
               "int8": flops / timed(lambda: torch._int_mm(ai, bi), 30) / 1e9}
        table.append(row)
        print(f"  {row['shape']:>16s}: fp32 {row['fp32']:6.0f}  bf16 {row['bf16']:6.0f}  int8 {row['int8']:6.0f} "
              f"G(FL)OP/s; int8 / bf16 {row['int8'] / row['bf16']:.2f}x")
    return table


def numerics(batch_size: int, method: str) -> dict:
    """Relative errors of logits and LoRA gradients on one batch against fp32 products (dropout off)."""
    from frugaltune.classify import collate
    from frugaltune.training.fast import frozen_weights_in
    from frugaltune.training.inference import autocast

    ids, labels = common.training_examples(1000 + batch_size)
    reference, tokenizer = common.lora_model(True, method, True)
    frozen_weights_in(reference, torch.float32)  # QLoRA's NF4 weights are not nn.Linear's: they stay 4-bit
    batch = collate(ids[1000:], tokenizer.pad_token_id)  # past the first rows, which share one label
    target = torch.tensor(labels[1000:])

    def run(model, bf16: bool):
        model.eval()
        model.zero_grad(set_to_none=True)
        with autocast(bf16, torch.device("cpu")):
            logits = model(**batch).logits
        torch.nn.functional.cross_entropy(logits.float(), target).backward()
        return logits.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_logits, ref_grads = run(reference, False)
    result = {}
    for name in ("bf16", "int8"):
        model, _ = common.lora_model(True, method, True)
        if method == "qlora":  # NF4 blocks and quant states are built from the same checkpoint; the rest is copied
            trained = {n for n, p in model.named_parameters() if p.requires_grad}
            state = {k: v for k, v in reference.state_dict().items() if k in trained}
            assert set(state) == trained, f"reference lacks {sorted(trained - set(state))[:3]}"
            model.load_state_dict(state, strict=False)
        else:
            model.load_state_dict(reference.state_dict())
        if name == "int8":
            to_int8(model, method)
        logits, grads = run(model, True)
        errors = sorted(((grads[n] - g).norm() / g.norm()).item() for n, g in ref_grads.items() if g.norm() > 0)
        result[name] = {"logits": ((logits - ref_logits).norm() / ref_logits.norm()).item(),
                        "grad_median": statistics.median(errors), "grad_p90": errors[int(0.9 * len(errors))]}
        print(f"  {name}: logits {result[name]['logits']:.4f}, LoRA gradients median {result[name]['grad_median']:.4f}"
              f" / p90 {result[name]['grad_p90']:.4f} (relative to fp32 products, batch of {len(target)} rows)")
    return result


def loop_ab(rounds: int, steps: int, batch_size: int, method: str) -> dict:
    from frugaltune.training.loop_config import LoopConfig

    ids, labels = common.training_examples(steps * batch_size * rounds)
    models = {}
    for name in ("bf16 products", "int8 products"):
        model, tokenizer = common.lora_model(True, method, True)
        if name.startswith("int8"):
            to_int8(model, method)
        models[name] = model

    def measure(number: int, name: str) -> float:
        part = slice(number * steps * batch_size, (number + 1) * steps * batch_size)
        cfg = LoopConfig.build(lr=1e-3, head_lr=2e-3, batch_size=batch_size, epochs=1, seed=42, bf16=True,
                               log_every=10**6, eager_attention_max_len=512)
        return loop_round(models[name], ids[part], labels[part], cfg, tokenizer.pad_token_id, number, name)

    rates = alternated(list(models), rounds, measure)
    base, new = (statistics.mean(v) for v in rates.values())
    print(f"  mean over {rounds - 1} rounds: {base:.1f} / {new:.1f} useful tok/s; int8 / bf16 = {new / base:.3f}x")
    return {"rates": rates, "ratio": new / base}


def quality(name: str, overrides: list[str]) -> None:
    """One quality_sweep variant with `train.int8_products=true` (the train stage's switch) before `overrides`."""
    import quality_sweep

    sys.argv = [sys.argv[0], name, "train.int8_products=true", *overrides]
    quality_sweep.main()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ab-rounds", type=int, default=3)
    parser.add_argument("--ab-steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--method", default="lora", choices=("lora", "dora", "qlora"))
    parser.add_argument("--quality", nargs="+", metavar="NAME [key=value]")
    args = parser.parse_args()
    if not hasattr(torch, "_int_mm"):
        raise SystemExit("int8_products: this torch has no torch._int_mm")
    if args.quality:
        quality(args.quality[0], args.quality[1:])
        return
    config = json.loads((common.BASE / "config.json").read_text())
    print(f"{cpu_facts()['model']}, {torch.get_num_threads()} threads")
    print("1. GEMMs at the model's shapes (M = batch 16 x 32 tokens):")
    table = gemm_table(512, config["hidden_size"], config["intermediate_size"])
    print("2. Numerics:")
    print(f"method: {args.method}")
    errors = numerics(args.batch_size, args.method)
    print("3. The loop, alternated:")
    started = time.perf_counter()
    ab = loop_ab(args.ab_rounds, args.ab_steps, args.batch_size, args.method)
    print(f"quantize / rescale: {status()['why']}")
    suffix = "" if args.method == "lora" else f"_{args.method}"  # LoRA's file keeps its name
    common.write_results(f"int8_products{suffix}", {
        "cpu": cpu_facts()["model"], "threads": torch.get_num_threads(), "method": args.method, "gemms": table,
        "numerics": errors, "loop": ab, "steps": status(), "loop_seconds": time.perf_counter() - started})


if __name__ == "__main__":
    main()
