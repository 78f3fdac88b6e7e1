"""Where a LoRA training step of frugaltune's loop spends its time: torch.profiler over N steps after a warm-up,
per-op tables by host time and by device time (the per-op table issue 12 asks for), on a CPU or a CUDA GPU.

    python benchmarks/profile_train_step.py                     # 20 steps of batch 16, the plan's precision
    python benchmarks/profile_train_step.py --steps 10 --no-cudnn-attention-fix
    python benchmarks/profile_train_step.py --by-shape mul,copy_,mm   # those ops split by their input shapes
    python benchmarks/profile_train_step.py --batch-size 8 --target-modules q_proj k_proj v_proj o_proj gate_proj \
        up_proj down_proj --last-layers 24                             # another adapter layout

Needs `models/base` and `data/tokenized` (`dvc repro tokenize`; on a machine without the GGUF,
benchmarks/gpu/random_base.py). On a CUDA device the loop runs as the train stage runs it, SDPA without cuDNN
(planner.keep_sdpa_off_cudnn), unless --no-cudnn-attention-fix: the profile that found that cost.
"""

from __future__ import annotations

import argparse

import common
import torch
from torch.profiler import ProfilerActivity, profile

from frugaltune import planner
from frugaltune.planner import keep_sdpa_off_cudnn
from frugaltune.training.loop import LoopConfig, train_classifier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                        help="default: the plan's (frugaltune.resolve: a GPU's compute capability; on a CPU, what the "
                             "kernels stage measured in reports/kernels.json)")
    parser.add_argument("--no-cudnn-attention-fix", action="store_true")
    parser.add_argument("--by-shape", default="", help="comma-separated aten ops (mul,copy_): a table of each by "
                        "input shapes, to tell which tensors an op's time goes to")
    parser.add_argument("--target-modules", nargs="+", default=list(planner.MethodKnobs().target_modules))
    parser.add_argument("--last-layers", type=int, default=None, help="LoRA on the last N decoder layers only")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    # the plan's precision (or --bf16's) and the attention the train stage runs in it: eager up to the length the
    # kernels stage measured it faster (CPU only); frugaltune.resolve reads both from the plan
    decided = common.machine("auto" if args.bf16 is None else "bf16" if args.bf16 else "fp32")
    bf16, eager_max = decided["bf16"], decided["eager_attention_max_len"]
    if not args.no_cudnn_attention_fix:
        keep_sdpa_off_cudnn()
    warm, timed = args.warmup * args.batch_size, args.steps * args.batch_size
    ids, labels = common.training_examples(warm + timed)
    knobs = planner.MethodKnobs(target_modules=tuple(args.target_modules), last_layers=args.last_layers)
    model, tokenizer = common.lora_model(bf16, "lora", True, knobs)
    cfg = LoopConfig(lr=1e-3, head_lr=2e-3, batch_size=args.batch_size, epochs=1, seed=42, bf16=bf16,
                     log_every=10**6, eager_attention_max_len=eager_max)
    train_classifier(model, ids[:warm], labels[:warm], cfg, tokenizer.pad_token_id, progress=False)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=bool(args.by_shape)) as prof:
        result = train_classifier(model, ids[warm:], labels[warm:], cfg, tokenizer.pad_token_id, progress=False)
    print(f"{result.steps} steps of {args.batch_size}: {result.wall_seconds:.2f} s under the profiler, "
          f"{result.tokens / result.wall_seconds:.0f} useful tok/s, {'bf16' if bf16 else 'fp32'}, eager attention "
          f"up to {eager_max} tokens, "
          f"{torch.cuda.get_device_name() if cuda else 'CPU'}")
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    if cuda:
        print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    for op in filter(None, (name.strip() for name in args.by_shape.split(","))):
        shaped = [e for e in prof.key_averages(group_by_input_shape=True) if e.key == f"aten::{op}"]
        shaped.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in shaped) or 1
        print(f"\naten::{op} by input shapes ({total / 1e3:.0f} ms self CPU in all):")
        for e in shaped[:12]:
            print(f"  {e.self_cpu_time_total / 1e3:8.1f} ms {e.self_cpu_time_total / total:6.1%} {e.count:7d} calls  "
                  f"{e.input_shapes}")


if __name__ == "__main__":
    main()
