"""A fixed prompt around each tweet, measured: does the classifier learn more in the same run when the last token
(where LlamaForSequenceClassification reads its features) is always the same "Sentiment:" position instead of the
tweet's own last token?

    python benchmarks/prompt_suffix.py                              # none vs suffix, common.seed
    python benchmarks/prompt_suffix.py --seeds 42 1 2               # the same over three seeds
    python benchmarks/prompt_suffix.py --variants none suffix both  # "both" also puts "Tweet: " in front

Run from the repository root after `make pipeline` (it reads data/tokenized/, models/base and reports/plan.json).
Each variant trains as the train stage does at params.yaml's `train.*` (frugaltune.training.setup: the model, its
int8 products and the LoopConfig the train stage builds, so its lr, head lr, batch, epochs, schedule and clipping;
the precision, attention crossover, micro-batch and int8 decision of this machine's plan, frugaltune.resolve), on
the tokenized rows wrapped in the variant's template as `train.input_template` wraps them
(frugaltune/input_template.py: the tweet cut so that prompt + tweet fit `tokenize.max_length`), then predicts the
test split like the evaluate stage (`loop.predict`, batch 32) and prints test macro-F1, accuracy, training seconds
and training tokens, per seed and, for each variant, its mean difference from the first variant. Variants run one
after the other in this process, in the order given, for each seed, whatever `train.input_template` params.yaml
sets.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from datasets import load_from_disk

from frugaltune import paths, resolve
from frugaltune.config import load_params
from frugaltune.hardware import cpu_facts
from frugaltune.input_template import InputTemplate, wrapped
from frugaltune.metrics import classification_metrics
from frugaltune.models import load_tokenizer
from frugaltune.training import setup
from frugaltune.training.loop import predict, train_classifier

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
    run = resolve.resolve_run(params)  # the train stage's run on this machine: the plan's decisions
    bf16 = run.bf16
    torch.set_num_threads(run.threads)
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
            model = setup.build_model(seeded, labels, tokenizer.pad_token_id, bf16, run.gradient_checkpointing)
            setup.apply_int8(model, run.int8, tp.method)
            cfg = setup.loop_config(seeded, method=tp.method, bf16=bf16, micro_batch_size=run.micro_batch_size,
                                    eager_attention_max_len=run.eager_attention_max_len, log_every=10 ** 6)
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
