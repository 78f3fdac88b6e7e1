"""A fixed prompt around each tweet, measured: does the classifier learn more in the same run when the last token
(where LlamaForSequenceClassification reads its features) is always the same "Sentiment:" position instead of the
tweet's own last token?

    python benchmarks/prompt_suffix.py                              # none vs suffix, common.seed
    python benchmarks/prompt_suffix.py --seeds 42 1 2               # the same over three seeds
    python benchmarks/prompt_suffix.py --variants none suffix both  # "both" also puts "Tweet: " in front

Run from the repository root after `make pipeline` (it reads data/tokenized/, models/base and reports/plan.json).
Each variant trains as the train stage does at params.yaml's `train.*` (stages.train.build_model, the one loop
`train_classifier` with the train stage's lr, head lr, batch, epochs, schedule and clipping; the precision and
attention this machine's plan measured), on the tokenized rows wrapped in the variant's template as
`train.input_template` wraps them (frugaltune/input_template.py: the tweet cut so that prompt + tweet fit
`tokenize.max_length`), then predicts the test split like the evaluate stage
(`loop.predict`, batch 32) and prints test macro-F1, accuracy, training seconds and training tokens, per seed and,
for each variant, its mean difference from the first variant. Variants run one after the other in this process,
in the order given, for each seed, whatever `train.input_template` params.yaml sets.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # stages/ when run as a script from the root

import numpy as np  # noqa: E402
import torch  # noqa: E402
from datasets import load_from_disk  # noqa: E402

from frugaltune import paths  # noqa: E402
from frugaltune.config import load_params  # noqa: E402
from frugaltune.hardware import cpu_facts  # noqa: E402
from frugaltune.input_template import InputTemplate, wrapped  # noqa: E402
from frugaltune.metrics import classification_metrics  # noqa: E402
from frugaltune.models import load_tokenizer  # noqa: E402
from frugaltune.training.loop import LoopConfig, predict, train_classifier  # noqa: E402
from stages.train import build_model  # noqa: E402

TEMPLATES = {"none": None, "suffix": "{text}\nSentiment:", "both": "Tweet: {text}\nSentiment:"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", choices=sorted(TEMPLATES), default=["none", "suffix"])
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: common.seed")
    args = parser.parse_args()
    params = load_params()
    tp = params.train
    if params.task.type != "classification" or tp.method == "none":
        raise SystemExit("prompt_suffix: needs task.type classification and a training train.method")
    plan = json.loads(paths.PLAN.read_text()).get("run", {}) if paths.PLAN.exists() else {}
    bf16, eager = plan.get("precision") == "bf16", int(plan.get("eager_attention_max_len", 0))
    labels = json.loads(paths.LABELS.read_text())["labels"]
    tokenizer = load_tokenizer(paths.BASE_MODEL)
    data = load_from_disk(str(paths.TOKENIZED_DIR))
    max_length = params.tokenize.max_length
    print(f"{cpu_facts()['model']}, {torch.get_num_threads()} threads, {'bf16' if bf16 else 'fp32'}; train.method "
          f"{tp.method}, lr {tp.lr} (head {tp.head_lr}), batch {tp.batch_size}, {tp.epochs} epoch(s)", flush=True)
    scores: dict[str, list[float]] = {}
    for seed in args.seeds or [params.common.seed]:
        seeded = params.model_copy(update={"common": params.common.model_copy(update={"seed": seed})})
        for variant in args.variants:
            template = InputTemplate.build(TEMPLATES[variant], tokenizer) if TEMPLATES[variant] else None
            train = wrapped(data["train"]["input_ids"], template, max_length)
            test = wrapped(data["test"]["input_ids"], template, max_length)
            model, lr = build_model(seeded, labels, tokenizer.pad_token_id, bf16)
            cfg = LoopConfig(lr=lr, head_lr=tp.head_lr, lora_plus_ratio=tp.lora_plus_ratio,
                             weight_decay=tp.weight_decay, scheduler=tp.scheduler, warmup_ratio=tp.warmup_ratio,
                             epochs=tp.epochs, max_steps=tp.max_steps, batch_size=tp.batch_size,
                             grad_accum=tp.grad_accum, max_grad_norm=tp.max_grad_norm, bf16=bf16,
                             group_by_length=tp.group_by_length, log_every=10 ** 6, seed=seed, checkpoint_dir=None,
                             eager_attention_max_len=eager)
            began = time.perf_counter()
            train_classifier(model, train, data["train"]["labels"], cfg, tokenizer.pad_token_id, progress=False)
            seconds = time.perf_counter() - began
            predictions = predict(model, test, tokenizer.pad_token_id, bf16=bf16, progress=False)
            metrics = classification_metrics(np.asarray(data["test"]["labels"]), predictions, labels)
            scores.setdefault(variant, []).append(metrics["macro_f1"])
            print(f"seed {seed} {variant} ({template.extra if template else 0} prompt tokens): test macro-F1 "
                  f"{metrics['macro_f1']:.4f}, accuracy {metrics['accuracy']:.4f}; {seconds:.0f} s training, "
                  f"{sum(map(len, train)):,} training tokens", flush=True)
    first = args.variants[0]
    for variant in args.variants[1:]:
        deltas = [b - a for a, b in zip(scores[first], scores[variant])]
        print(f"{variant} vs {first}: macro-F1 {' / '.join(f'{d:+.4f}' for d in deltas)}, mean "
              f"{sum(deltas) / len(deltas):+.4f} over {len(deltas)} seed(s)", flush=True)


if __name__ == "__main__":
    main()
