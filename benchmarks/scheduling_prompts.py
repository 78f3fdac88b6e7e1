"""The scheduling prompts the constrained-choice benchmarks time: their command-line options and loading.

Not run by itself; imported by `shared_prefix.py`, `choice_tail_pass.py` and `frozen_head.py` (run as
`python benchmarks/<name>.py` from the repository root, so this file is beside them on sys.path):

    add_arguments(parser)                                   # --rows --base --data --params --batch-size --repeats --fp32
    model, tokenizer, prompts, candidates = load(parser.parse_args())

`load` reads the base model of `make schedule` (fp32 from disk, cast to bf16 unless --fp32, eval mode), takes
`--rows` rows evenly spread over the SFT data, and templates their prompts with the scheduling params' system
message, as the evaluate_policy stage asks them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's frugaltune, not an installed one

import torch  # noqa: E402
import yaml  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from frugaltune.generation import prompt_ids  # noqa: E402
from frugaltune.models import load_tokenizer  # noqa: E402


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=60)
    parser.add_argument("--base", default="scheduling/models/base")
    parser.add_argument("--data", default="scheduling/data/sft.jsonl")
    parser.add_argument("--params", default="scheduling/params.yaml")
    parser.add_argument("--batch-size", type=int, default=20, help="prompts per forward (scheduling.llm.batch_size)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--fp32", action="store_true", help="fp32 weights (default: bf16, as on a bf16-fast CPU)")


def load(args: argparse.Namespace) -> tuple[Any, Any, list[list[int]], list[list[str]]]:
    """The model (eval mode, bf16 unless --fp32), its tokenizer, the templated prompts' ids and their candidates."""
    system = yaml.safe_load(Path(args.params).read_text())["task"].get("system")
    tokenizer = load_tokenizer(args.base)
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32, local_files_only=True)
    model = (model if args.fp32 else model.to(torch.bfloat16)).eval()
    lines = Path(args.data).read_text().splitlines()
    rows = [json.loads(line) for line in lines[::max(1, len(lines) // args.rows)][:args.rows]]
    prompts = [prompt_ids(tokenizer, row["prompt"], system, True) for row in rows]
    return model, tokenizer, prompts, [row["candidates"] for row in rows]
