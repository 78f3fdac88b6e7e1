"""What the rest of a CPU LoRA step is made of, once aten::mm runs near the measured peak (issue 12's MFU gap).

    python benchmarks/step_anatomy.py                    # matmul shapes: separate vs fused projections, LoRA's
    python benchmarks/step_anatomy.py --ab-rounds 4      #   + frozen weights stored in bf16 vs autocast, alternated
    python benchmarks/step_anatomy.py --ab-rounds 4 --ab compiled   # + decoder layers under torch.compile vs eager
    python benchmarks/step_anatomy.py --ab-rounds 5 --ab optimizer  # + AdamW as one fused kernel vs torch's default
    python benchmarks/step_anatomy.py --ab-rounds 5 --ab grouped    # + int8 siblings as one product (int8 on)
    python benchmarks/step_anatomy.py --ab-paired 60 --ab int8lora  # + LoRA over int8 as one node, steps paired
    python benchmarks/step_anatomy.py --ab-paired 60 --ab same --int8  # the paired A/B's A/A (its bias)

Needs `models/base` and `data/tokenized` (`make pipeline`). On this machine's threads, in the plan's precision and
with its attention crossover (frugaltune.resolve, as `dvc repro train` reads them):

1. **Matmul shapes of one decoder layer** of the base model (read from models/base/config.json) for a batch of
   M = batch x mean training length rows: q/k/v as three products against one fused [q;k;v] product, gate/up as
   two against one, forward and backward (the input gradient: base weights are frozen under LoRA), then down, o,
   LoRA's rank-r products and one activation cast, each with its GFLOP/s. This is the
   question "fewer, larger matmuls" asks, answered on bare tensors before any model surgery.
2. **`--ab-rounds N`**: the frozen base weights stored once in bf16 (autocast then casts no weight; what
   `prepare_model` does for LoRA in bf16 since 2026-11-25) against fp32 weights cast by autocast at every use:
   two models trained by the project's loop on the same slices of data, alternating which goes first, N rounds
   (the first is a warm-up and not counted). Alternation within one process, not two runs minutes apart, is what
   makes a few percent visible on a shared machine. `--ab compiled` does the same for regional compilation: every
   decoder layer `torch.compile`d in place (inductor, dynamic shapes: length-grouped batches change the length),
   which is what would fuse the elementwise work around the matmuls; the warm-up round then includes the
   compilation (each round prints its seconds). `--ab optimizer` compares AdamW fused (one kernel over all
   trainable tensors, the default since 2026-11-26) with torch's default per-tensor loop; `--ab grouped` compares
   q/k/v and gate/up as one int8 product each (`int8.apply`'s default since 2026-11-28) with each product on its
   own; `--ab int8lora` compares `fused_int8_lora` (LoRA over each int8 product as one autograd node) with peft's
   layers. Both int8 A/Bs force int8 products on (whatever the plan decided: they compare two ways of computing
   them); `--int8` puts the other A/Bs' models on int8 products where the plan decided them for LoRA
   (`train.int8_products`). Every variant uses the loop's defaults but for what it compares (fused optimizer and
   fused_int8_lora on). `--ab-paired N` runs the chosen A/B as N steps of each model taking turns step by step
   (two threads, one computing at a time; pairs alternate which goes first) and prints per-step speed ratios;
   `--ab same` is its A/A (the defaults against themselves), which shows what the method reads where nothing
   differs.
3. **`--layer-compile`**: one decoder layer of the LoRA model (the first `--batch-size` training rows, padded to
   their longest), forward + backward under the planned precision, eager against `torch.compile` (inductor,
   static shapes), with LoRA's dropout as the project's `SharedDropout`, as `nn.Dropout` and as none. Prints the
   graph breaks dynamo finds, the compilation's seconds and ms per call, eager and compiled alternated. This says
   whether compilation could fuse the elementwise work around the matmuls before any A/B of the whole loop.
4. **`--floor`**: the loop's seconds per step for steps of 1 row x 8 tokens (nearly no arithmetic: what every
   step pays whatever its size) beside steps of the batch, alternated, and the share of the floor in a batch step.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import common
import torch

from frugaltune.planner.machine import keep_sdpa_off_cudnn
from frugaltune.planner.memory import MethodKnobs
from frugaltune.hardware import cpu_facts


def matmul_table(rows: int, hidden: int, q_out: int, kv_out: int, mlp: int, rank: int, dtype: torch.dtype,
                 repeats: int) -> None:
    torch.manual_seed(0)

    def w(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, dtype=dtype) / inp ** 0.5

    x = torch.randn(rows, hidden, dtype=dtype)
    wq, wk, wv, wo, wg, wu, wd = w(q_out, hidden), w(kv_out, hidden), w(kv_out, hidden), w(hidden, q_out), \
        w(mlp, hidden), w(mlp, hidden), w(hidden, mlp)
    wqkv, wgu = torch.cat([wq, wk, wv]), torch.cat([wg, wu])
    gq, gk, gv = (torch.randn(rows, n, dtype=dtype) for n in (q_out, kv_out, kv_out))
    gqkv = torch.cat([gq, gk, gv], 1)
    gg, gu = torch.randn(rows, mlp, dtype=dtype), torch.randn(rows, mlp, dtype=dtype)
    ggu = torch.cat([gg, gu], 1)
    a, b, h = w(rank, hidden), w(hidden, rank), torch.randn(rows, rank, dtype=dtype)
    x32, grad = torch.randn(rows, hidden), torch.randn(rows, hidden, dtype=dtype)
    qkv, gate_up = hidden * (q_out + 2 * kv_out), hidden * 2 * mlp
    cases = [  # name, function, multiply-adds
        ("q, k, v: three products", lambda: (x @ wq.t(), x @ wk.t(), x @ wv.t()), qkv),
        ("q, k, v: one fused product", lambda: x @ wqkv.t(), qkv),
        ("q, k, v backward: three + sum", lambda: gq @ wq + gk @ wk + gv @ wv, qkv),
        ("q, k, v backward: one fused", lambda: gqkv @ wqkv, qkv),
        ("gate, up: two products", lambda: (x @ wg.t(), x @ wu.t()), gate_up),
        ("gate, up: one fused product", lambda: x @ wgu.t(), gate_up),
        ("gate, up backward: two + sum", lambda: gg @ wg + gu @ wu, gate_up),
        ("gate, up backward: one fused", lambda: ggu @ wgu, gate_up),
        ("down", lambda: gg @ wd.t(), hidden * mlp),
        ("down backward", lambda: x @ wd, hidden * mlp),
        ("o", lambda: gq @ wo.t(), hidden * q_out),
        ("o backward", lambda: x @ wo, hidden * q_out),
        (f"LoRA x A^T (rank {rank})", lambda: x @ a.t(), hidden * rank),
        ("LoRA h B^T", lambda: h @ b.t(), hidden * rank),
        ("LoRA grad of B (g^T h)", lambda: grad.t() @ h, hidden * rank),
        ("LoRA grad of A (h^T x)", lambda: h.t() @ x, hidden * rank),
        ("cast of one activation fp32 -> " + str(dtype).split(".")[-1], lambda: x32.to(dtype), 0),
    ]
    print(f"{rows} rows x hidden {hidden} (q {q_out}, k/v {kv_out}, MLP {mlp}), {str(dtype).split('.')[-1]}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'product':34s} {'ms':>8s} {'GFLOP/s':>8s}")
    for name, fn, macs in cases:
        seconds = common.timed(fn, repeats)
        rate = f"{2 * rows * macs / seconds / 1e9:8.0f}" if macs else f"{'':8s}"
        print(f"{name:34s} {seconds * 1e3:8.3f} {rate}")


def paired_steps(runs: dict[str, object]) -> dict[str, list[float]]:
    """Each of two runs (`run(on_log=...)`: the project's loop with `log_every=1`) in its own thread, taking turns
    step by step on the same batches, in pairs whose order alternates (A B, B A, A B, ...): step i of one is timed
    seconds from step i of the other, on the same machine state, and whatever favours the first (or the second) of
    a pair falls on each run equally often. Returns each run's step seconds, pair k at index k, without the last
    step (the other thread's wrap-up may overlap it)."""
    import threading

    names = list(runs)
    turn = threading.Condition()
    state = {"position": 0, "done": set()}
    seconds: dict[str, list[float]] = {name: [] for name in names}
    errors: list[BaseException] = []

    def whose(position: int) -> str:  # pairs A B, B A, A B, ...: position 2k + j -> names[j] or names[1 - j]
        pair, j = divmod(position, 2)
        return names[j if pair % 2 == 0 else 1 - j]

    def wait_turn(name: str) -> None:
        with turn:
            turn.wait_for(lambda: whose(state["position"]) == name or set(names) - {name} <= state["done"])

    def worker(name: str) -> None:
        started = [0.0]

        def on_log(_record: dict) -> None:
            seconds[name].append(time.perf_counter() - started[0])
            with turn:
                state["position"] += 1
                turn.notify_all()
            wait_turn(name)
            started[0] = time.perf_counter()

        wait_turn(name)
        started[0] = time.perf_counter()
        try:
            runs[name](on_log=on_log)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
        finally:
            with turn:
                state["done"].add(name)
                turn.notify_all()

    threads = [threading.Thread(target=worker, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return {name: values[:-1] for name, values in seconds.items()}


def report_pairs(seconds: dict[str, list[float]], warmup: int = 3) -> float:
    """Per-step speed ratios of two paired runs (the first's seconds over the second's: > 1, the second is faster),
    after the first `warmup` pairs. Pairs where the first ran first and pairs where the second did are summarised
    apart (their medians), and the estimate is the geometric mean of the two medians: a bias for the first or the
    second of a pair cancels in it (an A/A run shows how large that bias is). Returns the estimate."""
    (base, base_s), (new, new_s) = ((name, values[warmup:]) for name, values in seconds.items())
    ratios = [a / b for a, b in zip(base_s, new_s)]
    # pair k (counted from 0 before the warm-up was cut) ran the first run first when k is even
    first = [r for k, r in enumerate(ratios, start=warmup) if k % 2 == 0]
    second = [r for k, r in enumerate(ratios, start=warmup) if k % 2 == 1]
    estimate = (statistics.median(first) * statistics.median(second)) ** 0.5
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    print(f"{len(ratios)} paired steps: {base} {sum(base_s):.1f} s, {new} {sum(new_s):.1f} s "
          f"({sum(base_s) / sum(new_s):.3f}x); per step, {new} / {base} speed: median {statistics.median(first):.3f}x "
          f"where {base} ran first ({len(first)} pairs), {statistics.median(second):.3f}x where {new} did "
          f"({len(second)}); estimate {estimate:.3f}x (quartiles of all pairs {q1:.3f}-{q3:.3f}x)")
    return estimate


def ab_switch(switch: str, rounds: int, steps: int, batch_size: int, bf16: bool, eager: int,
              target_modules: list[str] | None = None, int8_products: bool = False, paired: int = 0) -> None:
    """One speed switch off against on, two models trained by the project's loop on the same slices of data,
    alternating which goes first; the first round warms both up and is not counted. `int8_products`: both models'
    frozen products in int8 where the plan decided them for LoRA (`train.int8_products`), as the train stage does;
    `grouped` and `int8lora` compare two ways of computing int8 products, so both their models have them forced
    on. `paired` > 0: instead, both loops over the same `paired` batches, taking turns step by step (paired_steps)."""
    from frugaltune import int8, methods
    from frugaltune.training.fast import frozen_weights_in
    from frugaltune.training.loop_config import LoopConfig

    ids, labels = common.training_examples(max(steps * rounds, paired) * batch_size)
    if torch.cuda.is_available():  # as the train stage and train_throughput's frugaltune recipe do on a GPU
        keep_sdpa_off_cudnn()
    variants = {"frozen": ("fp32 weights, autocast casts", "frozen weights stored in bf16"),
                "compiled": ("eager", "decoder layers compiled"),
                "optimizer": ("AdamW, torch's default", "AdamW fused"),
                "grouped": ("each int8 product alone", "int8 siblings grouped"),
                "same": ("the defaults", "the defaults again"),  # A/A: the method's bias
                "int8lora": ("peft's LoRA layers", "one node per int8 product (fused_int8_lora)"),
                }[switch]
    if switch in ("grouped", "int8lora"):
        decision = common.forced_int8(True)
    elif int8_products:
        decision = common.machine(int8=True)["int8"]
    else:
        decision = common.forced_int8(False)
    models = {}
    for name in variants:
        knobs = MethodKnobs(target_modules=tuple(target_modules)) if target_modules else None
        model, tokenizer = common.lora_model(bf16, "lora", True, knobs)  # bf16 frozen weights when bf16
        stored = {"fp32 weights, autocast casts": torch.float32, "frozen weights stored in bf16": torch.bfloat16}
        if name in stored:
            frozen_weights_in(model, stored[name])
        if decision["on"]:
            grouped = name != "each int8 product alone"  # int8.apply groups siblings by default
            print(f"{name}: int8 products {int8.apply(model, decision, methods.get('lora'), grouped=grouped)}")
        if name == "decoder layers compiled":
            for module in model.modules():  # regional: each decoder layer, not the whole model and the loop
                if type(module).__name__.endswith("DecoderLayer"):
                    module.compile(dynamic=True)
        models[name] = model
        kinds = {str(m.weight.dtype) for m in model.modules()
                 if type(m) is torch.nn.Linear and not m.weight.requires_grad}
        print(f"{name}: frozen Linear weights in {', '.join(sorted(kinds))}")

    def config(name: str, log_every: int) -> LoopConfig:
        return LoopConfig.build(lr=1e-3, head_lr=2e-3, batch_size=batch_size, epochs=1, seed=42, bf16=bf16,
                                log_every=log_every, eager_attention_max_len=eager,
                                fused_optimizer=name != "AdamW, torch's default",
                                fused_int8_lora=name != "peft's LoRA layers")

    if paired:
        from frugaltune.training.loop import train_classifier

        rows = slice(0, paired * batch_size)
        runs = {name: functools.partial(train_classifier, models[name], ids[rows], labels[rows], config(name, 1),
                                        tokenizer.pad_token_id, progress=False) for name in models}
        report_pairs(paired_steps(runs))
        return

    def measure(number: int, name: str) -> float:
        part = slice(number * steps * batch_size, (number + 1) * steps * batch_size)
        return common.loop_round(models[name], ids[part], labels[part], config(name, 10**6), tokenizer.pad_token_id,
                                 number, name)

    rates = common.alternated(list(models), rounds, measure)
    base, new = (statistics.mean(v) for v in rates.values())
    names = list(rates)
    print(f"mean over {rounds - 1} rounds: {' / '.join(f'{statistics.mean(v):.1f}' for v in rates.values())} "
          f"useful tok/s; {names[1]} / {names[0]} = {new / base:.3f}x")


def layer_compile(batch_size: int, bf16: bool, repeats: int = 20) -> None:
    """One decoder layer, eager vs torch.compile'd, for each kind of LoRA dropout (see the module docstring)."""
    import copy

    model, _ = common.lora_model(bf16, "lora", True)
    model.train()
    decoder = model.get_base_model().model
    ids, _ = common.training_examples(batch_size)
    length = max(len(x) for x in ids)
    x = torch.randn(batch_size, length, decoder.config.hidden_size, requires_grad=True)
    positions = torch.arange(length).unsqueeze(0).expand(batch_size, length)
    rotary = decoder.rotary_emb(x, positions)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)

    def step(layer) -> None:
        with autocast:
            out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        (out[0] if isinstance(out, tuple) else out).float().pow(2).mean().backward()

    print(f"one decoder layer, {batch_size} x {length} tokens, {'bf16' if bf16 else 'fp32'}, forward + backward:")
    p = MethodKnobs().dropout
    for kind, make in (("SharedDropout (the loop's)", None), ("nn.Dropout", lambda: torch.nn.Dropout(p)),
                       ("no dropout", torch.nn.Identity)):
        eager = copy.deepcopy(decoder.layers[0])
        if make is not None:
            common.replace_lora_dropouts(eager, make)
        compiled = torch.compile(copy.deepcopy(eager))  # before any forward: SharedDropout then caches no output
        with autocast:
            explained = torch._dynamo.explain(eager)(x, attention_mask=None, position_ids=positions,
                                                     position_embeddings=rotary)
        began = time.perf_counter()
        step(compiled)
        compile_s = time.perf_counter() - began
        layers = {"compiled": compiled, "eager": eager}
        times = common.alternated(list(layers), 4,
                                 lambda number, name: common.timed(lambda: step(layers[name]), repeats))
        e, c = (statistics.mean(times[name]) * 1e3 for name in ("eager", "compiled"))
        print(f"  {kind:27s} graph breaks {explained.graph_break_count}, compile {compile_s:5.1f} s: "
              f"eager {e:.2f} ms, compiled {c:.2f} ms, compiled {e / c:.3f}x")
        torch._dynamo.reset()


def step_floor(batch_size: int, bf16: bool, eager: int, steps: int = 12, rounds: int = 4) -> None:
    """Seconds per step of the loop for 1 x 8-token steps against steps of the batch (see the module docstring)."""
    from frugaltune.training.loop import train_classifier
    from frugaltune.training.loop_config import LoopConfig

    model, tokenizer = common.lora_model(bf16, "lora", True)
    ids, labels = common.training_examples(steps * batch_size)
    tiny, full = "1 x 8 tokens", f"batch {batch_size}"
    shapes = {full: (ids, labels, batch_size), tiny: ([x[:8] for x in ids[:steps]], labels[:steps], 1)}
    tokens = {}

    def measure(number: int, name: str) -> float:
        rows, marks, batch = shapes[name]
        cfg = LoopConfig.build(lr=1e-3, head_lr=2e-3, batch_size=batch, epochs=1, seed=42, bf16=bf16,
                               log_every=10**6, eager_attention_max_len=eager)
        result = train_classifier(model, rows, marks, cfg, tokenizer.pad_token_id, progress=False)
        tokens[name] = result.tokens / steps
        return result.wall_seconds / steps

    per_step = common.alternated(list(shapes), rounds, measure)
    floor, whole = (statistics.mean(per_step[name]) for name in (tiny, full))
    for name in (tiny, full):
        values = per_step[name]
        print(f"  {name}: {statistics.mean(values) * 1e3:.0f} ms a step ({tokens[name]:.0f} useful tokens), "
              f"rounds {' / '.join(f'{v * 1e3:.0f}' for v in values)} ms")
    print(f"  the floor is {floor / whole:.0%} of a step of batch {batch_size}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--ab-rounds", type=int, default=0, help="> 1: also an A/B of a switch, this many rounds")
    parser.add_argument("--ab", default="frozen",
                        choices=["frozen", "compiled", "optimizer", "grouped", "int8lora", "same"],
                        help="frozen: bf16-stored frozen weights vs autocast casts; "
                             "compiled: decoder layers under torch.compile vs eager; "
                             "optimizer: AdamW fused vs torch's default; grouped: int8 siblings alone vs grouped; "
                             "int8lora: peft's LoRA layers vs fused_int8_lora; "
                             "same: the defaults against themselves (an A/A: what the method reads where nothing "
                             "differs)")
    parser.add_argument("--ab-steps", type=int, default=12, help="steps per model per round")
    parser.add_argument("--ab-paired", type=int, default=0,
                        help="N > 0: the A/B as N steps per model taking turns step by step (per-step ratios), "
                             "instead of alternated rounds")
    parser.add_argument("--target-modules", nargs="+", default=None,
                        help="the A/B's LoRA targets (default: params' q/k/v/o), e.g. all seven linear layers")
    parser.add_argument("--int8", action="store_true",
                        help="the A/B's models with int8 frozen products where the plan decided them for LoRA")
    parser.add_argument("--layer-compile", action="store_true", help="also one decoder layer eager vs compiled")
    parser.add_argument("--layer-repeats", type=int, default=20,
                        help="--layer-compile's timed forward + backward passes per layer per round (--repeats is the "
                             "matmul table's)")
    parser.add_argument("--floor", action="store_true", help="also a step's fixed cost (1 x 8 tokens vs the batch)")
    args = parser.parse_args()
    decided = common.machine()  # the plan's precision and attention crossover, as the train stage reads them
    bf16, why, eager = decided["bf16"], decided["precision_why"], decided["eager_attention_max_len"]
    config = json.loads(Path(common.BASE, "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    ids, _ = common.training_examples(512)
    rows = round(args.batch_size * statistics.mean(len(x) for x in ids))
    print(f"{cpu_facts()['model']}; {'bf16' if bf16 else 'fp32'} ({why})")
    matmul_table(rows, hidden, heads * head_dim, config["num_key_value_heads"] * head_dim,
                 config["intermediate_size"], 8, torch.bfloat16 if bf16 else torch.float32, args.repeats)
    if args.ab_rounds > 1 or args.ab_paired:
        ab_switch(args.ab, max(args.ab_rounds, 1), args.ab_steps, args.batch_size, bf16, eager, args.target_modules,
                  args.int8, args.ab_paired)
    if args.layer_compile:
        layer_compile(args.batch_size, bf16, args.layer_repeats)
    if args.floor:
        step_floor(args.batch_size, bf16, eager)


if __name__ == "__main__":
    main()
