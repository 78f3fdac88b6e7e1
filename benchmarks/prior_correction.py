"""Would correcting the head for the label prior raise macro-F1? The trained adapter's logits on the validation and
test splits, minus tau x log(training split's label prior), for a few tau; no retraining (issue 12's 0.76 criterion).

    python benchmarks/prior_correction.py                   # models/adapter, tau 0 / 0.5 / 1
    python benchmarks/prior_correction.py --tau 0 0.25 1 --adapter models/sweep/NAME

Needs the pipeline's outputs (`make pipeline`): models/base, models/adapter, data/tokenized, data/splits/labels.json,
reports/train.json (the precision the adapter trained in; evaluated in it, as the evaluate stage does). tau 0 is the
evaluate stage's own argmax. Logit adjustment (Menon et al., 2021) shifts predictions toward rare labels, which
helps macro-F1 when a model's errors follow the label prior; a drop at tau > 0 says they do not.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from datasets import load_from_disk

from frugaltune import paths
from frugaltune.config import load_params
from frugaltune.hardware import cpu_facts
from frugaltune.io import read_json
from frugaltune.metrics import classification_metrics
from frugaltune.models import load_for_classification, load_tokenizer
from frugaltune.training.batching import collate, sorted_batches
from frugaltune.training.loop import autocast
from frugaltune.training.methods import load_trained


@torch.no_grad()
def logits_of(model: torch.nn.Module, input_ids: list[list[int]], pad_token_id: int, bf16: bool) -> np.ndarray:
    out = np.zeros((len(input_ids), model.config.num_labels), dtype=np.float32)
    for batch in sorted_batches([len(ids) for ids in input_ids], 32):
        inputs = collate([input_ids[i] for i in batch], pad_token_id)
        with autocast(bf16, torch.device("cpu")):  # the evaluate stage's autocast
            out[batch] = model(**inputs).logits.float().numpy()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapter", default=str(paths.PIPELINE_RUN.adapter_dir))
    parser.add_argument("--tau", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    args = parser.parse_args()
    labels = read_json(paths.LABELS)["labels"]
    bf16 = bool(read_json(paths.report("train")).get("bf16", False))
    data = load_from_disk(str(paths.TOKENIZED_DIR))
    tokenizer = load_tokenizer(paths.BASE_MODEL)
    model = load_for_classification(paths.BASE_MODEL, labels, tokenizer.pad_token_id, load_params().common.seed)
    model = load_trained(model, args.adapter).eval()
    counts = np.bincount(np.asarray(data["train"]["labels"]), minlength=len(labels))
    prior = counts / counts.sum()
    print(f"{cpu_facts()['model']}, {torch.get_num_threads()} threads, {'bf16' if bf16 else 'fp32'}; "
          f"adapter {args.adapter}; training prior " + ", ".join(f"{n} {p:.3f}" for n, p in zip(labels, prior)))
    for split in ("val", "test"):
        logits = logits_of(model, data[split]["input_ids"], tokenizer.pad_token_id, bf16)
        truth = np.asarray(data[split]["labels"])
        scores = [classification_metrics(truth, (logits - tau * np.log(prior)).argmax(-1), labels)["macro_f1"]
                  for tau in args.tau]
        print(f"{split}: macro-F1 " + " / ".join(f"{s:.4f}" for s in scores)
              + f" at tau {' / '.join(f'{t:g}' for t in args.tau)}", flush=True)


if __name__ == "__main__":
    main()
