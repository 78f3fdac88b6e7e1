"""Lay out `models/base` (and, if given, the tokenized data and labels) on a machine that cannot receive the
embedded GGUF: SmolLM2-135M from its config and tokenizer files, with random weights. For speed measurements only
(training throughput and profiles do not depend on the weights' values); accuracy figures need the real weights.

    python benchmarks/gpu/random_base.py SRC [--tokenized DIR] [--labels FILE]

SRC holds `config.json` and the tokenizer files of this checkout's `models/base` (everything there except
`model.safetensors`, ~3.5 MB): the device tool carries 64 MiB, and the GGUF alone is 98 MB. Used on the lent H100
(docs/DECISIONS.md, "On a lent GPU") before `benchmarks/train_throughput.py` and `benchmarks/plan_accuracy.py`.
It refuses to replace real weights (`models/base/model.safetensors` present) without --force; it is a lease's setup,
not a benchmark, so it lives in gpu/ and is not in `make bench`'s list.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="config.json + tokenizer files of models/base")
    parser.add_argument("--tokenized", type=Path, help="a copy of data/tokenized to put in place")
    parser.add_argument("--labels", type=Path, help="a copy of data/splits/labels.json to put in place")
    parser.add_argument("--force", action="store_true", help="replace the weights already in models/base")
    args = parser.parse_args()
    if Path("models/base/model.safetensors").exists() and not args.force:
        raise SystemExit("models/base already holds weights: random ones would replace them (and every figure "
                         "from them would be meaningless). Use --force on a machine set up only for speed runs.")
    config = AutoConfig.from_pretrained(str(args.src))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained("models/base")
    for f in args.src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, Path("models/base") / f.name)
    if args.labels:
        Path("data/splits").mkdir(parents=True, exist_ok=True)
        shutil.copy(args.labels, "data/splits/labels.json")
    if args.tokenized:
        shutil.copytree(args.tokenized, "data/tokenized", dirs_exist_ok=True)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"models/base: {config.architectures} with {params:.1f} M random parameters")


if __name__ == "__main__":
    main()
