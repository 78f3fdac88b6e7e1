"""What a federated client and the server do with the model, without Flower: build the LoRA model for a rank, move
the trainable tensors in and out, train locally with the project's trainer, evaluate centrally.

Library code, called by `frugaltune.federated.client_app` and `server_app` and by benchmarks/federated_rounds.py
(and unit-tested without Flower). A client's round is `train_round`, whichever of them runs it; the training itself
is `frugaltune.training.loop.train_classifier`, the same loop the `train` stage runs.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from frugaltune.classify import classify
from frugaltune.federated import aggregation
from frugaltune.federated.settings import RoundSettings
from frugaltune import methods
from frugaltune.methods import MethodKnobs
from frugaltune.metrics import classification_metrics
from frugaltune.training.loop import TrainResult, train_classifier
from frugaltune.training.loop_config import LoopConfig
from frugaltune.training.methods import prepare_model


def build_model(model_dir: Path | str, labels: list[str], pad_token_id: int, seed: int, lora: MethodKnobs,
                rank: int | None = None, bf16: bool = False, int8: bool = False) -> torch.nn.Module:
    """The base model with the seeded head and LoRA of `rank` (default: the global adapter's, `lora`: every client
    uses its target modules and alpha/r, its own rank <= r), alpha scaled to keep alpha/r (see
    aggregation.client_alpha); every layer adapts (config refuses federated.lora.last_layers). `bf16`: the model will train or evaluate under bf16 autocast, so its
    frozen projections are stored in bf16 once, as the train stage's are (`prepare_model`): the same products,
    without a cast of every frozen weight at every use and with half their memory. `int8`: a model that trains
    with the plan's int8 products (frugaltune/int8.py, as the train stage's LoRA): its frozen Linears in int8; the
    tensors that train and travel (A, B, head) are the same, so it takes and gives the same globals."""
    rank = rank or lora.r
    knobs = replace(lora, r=rank, alpha=aggregation.client_alpha(lora.alpha, lora.r, rank))
    method = methods.get("lora")
    model = prepare_model(model_dir, labels, pad_token_id, seed, method, knobs, bf16=bf16)
    if int8:
        from frugaltune import int8 as products

        products.apply(model, {"on": True, "why": "the plan's int8 decision for LoRA"}, method)
    return model


# (model-dir, labels, pad id, seed, LoRA spec, rank, bf16, int8) -> (model, names of its trainable tensors)
_MODELS: dict[tuple, tuple[torch.nn.Module, list[str]]] = {}


def cached_model(model_dir: str, labels: list[str], pad_token_id: int, seed: int, spec: MethodKnobs,
                 rank: int, bf16: bool = False, int8: bool = False) -> tuple[torch.nn.Module, bool]:
    """The LoRA model for `rank`, built once per process, and whether this call reused it. Every trainable tensor
    (A, B, head) is overwritten by the round's global before training (`train_round`), so a reused model trains
    exactly as a fresh one; what a previous round froze (FFA's A) trains again until the round freezes it."""
    key = (model_dir, tuple(labels), pad_token_id, seed, spec, rank, bf16, int8)
    reused = key in _MODELS
    if not reused:
        if len(_MODELS) >= 2:  # a process sees at most the ranks of its clients; keep memory bounded
            _MODELS.pop(next(iter(_MODELS)))
        model = build_model(model_dir, labels, pad_token_id, seed, spec, rank, bf16=bf16, int8=int8)
        _MODELS[key] = (model, [name for name, param in model.named_parameters() if param.requires_grad])
    model, trainable = _MODELS[key]
    params = dict(model.named_parameters())
    for name in trainable:
        params[name].requires_grad_(True)
    return model, reused


def train_round(model: torch.nn.Module, received: dict[str, torch.Tensor], rank: int, settings: RoundSettings,
                input_ids: list[list[int]], targets: list[int], *, local_steps: int | None = None,
                micro_batch_size: int | None = None, bf16: bool = False, eager_attention_max_len: int = 0,
                optimizer_state: dict | None = None) -> tuple[dict[str, torch.Tensor], TrainResult, dict]:
    """One client's round: the global (`received`) cut to this client's `rank` and loaded, LoRA A frozen under FFA,
    `local_steps` (default: the round's) of local training at the round's rates, then the trained tensors, clipped
    and noised when the round asks for differential privacy. Returns what the client sends (before the wire), the
    training's result and the privacy report (empty without DP). The ClientApp and the benchmark both run it."""
    start = aggregation.slice_to_rank(received, rank)
    load_tensors(model, start)
    if settings.method == "ffa":
        freeze_lora_a(model)
    result = train_locally(model, input_ids, targets, settings.pad_token_id, steps=local_steps or settings.local_steps,
                           lr=settings.lr, head_lr=settings.head_lr or None, batch_size=settings.batch_size,
                           micro_batch_size=micro_batch_size, seed=settings.seed * 1000 + settings.round,
                           proximal_mu=settings.proximal_mu, bf16=bf16,
                           eager_attention_max_len=eager_attention_max_len,
                           logit_adjustment=settings.logit_adjustment, optimizer_state=optimizer_state)
    trained, privacy = trainable_tensors(model), {}
    if settings.dp_epsilon > 0:  # federated.dp: clip + noise the update before it leaves
        from frugaltune.federated.privacy import privatize  # Flower's DP primitives: the Flower venv

        trained, privacy = privatize(trained, start, settings.dp_clip, settings.dp_epsilon, settings.dp_delta)
    return trained, result, privacy


def trainable_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Exactly the tensors that train (LoRA A/B, head): the only ones that travel."""
    return {name: param.detach().cpu().clone() for name, param in model.named_parameters() if param.requires_grad}


def load_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy `tensors` (already cut to this model's rank) into the model's parameters of the same names."""
    params = dict(model.named_parameters())
    missing = [name for name in tensors if name not in params]
    if missing:
        raise KeyError(f"federated: the global adapter has {missing[0]} (and {len(missing) - 1} more) that this "
                       "client's model lacks: do server and client use the same base model and target_modules?")
    with torch.no_grad():
        for name, tensor in tensors.items():
            if params[name].shape != tensor.shape:
                raise ValueError(f"{name}: global tensor {tuple(tensor.shape)} vs this model's "
                                 f"{tuple(params[name].shape)}")
            params[name].copy_(tensor.to(params[name].dtype))


def freeze_lora_a(model: torch.nn.Module) -> None:
    """FFA-LoRA: A stays at the server's seeded initialisation on every client, so B alone trains and travels."""
    for name, param in model.named_parameters():
        if aggregation.is_lora_a(name):
            param.requires_grad_(False)


def read_examples(path: Path | str) -> tuple[list[list[int]], list[int]]:
    """input_ids and labels of a tokenized split or partition (parquet)."""
    table = pq.read_table(str(path), columns=["input_ids", "labels"])
    return table.column("input_ids").to_pylist(), [int(v) for v in table.column("labels").to_pylist()]


def proximal_term(model: torch.nn.Module, mu: float):
    """FedProx (Li et al., 2020): mu/2 * ||w - w_global||^2 over the trainable tensors, w_global being their values
    now (the global adapter just loaded). It pulls each client's update back toward the global weights, which keeps
    clients with skewed data from drifting apart over their local steps; mu = 0 is plain FedAvg."""
    params = [param for param in model.parameters() if param.requires_grad]
    anchors = [param.detach().clone() for param in params]

    def term() -> torch.Tensor:
        return mu / 2 * sum(((param - anchor) ** 2).sum() for param, anchor in zip(params, anchors))
    return term


def label_log_prior(labels: list[int], num_labels: int) -> torch.Tensor:
    """log of this client's label frequencies, add-one smoothed (a label it never saw gets a small prior, not
    log 0)."""
    counts = torch.bincount(torch.tensor(labels, dtype=torch.long), minlength=num_labels).double() + 1.0
    return (counts / counts.sum()).log().float()


def head_module(model: torch.nn.Module) -> torch.nn.Module:
    """The classification head (`score`; under peft, its wrapper, whose output is the head's logits)."""
    names = sorted((name for name, _ in model.named_modules() if name.split(".")[-1] == "score"), key=len)
    if not names:
        raise ValueError("federated logit adjustment: the model has no `score` head (a sequence classifier has)")
    return model.get_submodule(names[0])


def client_loop(*, steps: int, lr: float, batch_size: int, micro_batch_size: int | None, seed: int,
                head_lr: float | None = None, bf16: bool = False, eager_attention_max_len: int = 0,
                scheduler: str = "constant", warmup_ratio: float = 0.0) -> LoopConfig:
    """A client's round as the loop's settings (train_locally's; the budget's calibration times the same): `steps`
    steps, no checkpoints, one logged record at the end; the rest the loop's defaults."""
    return LoopConfig.build(lr=lr, head_lr=head_lr, max_steps=steps, batch_size=batch_size,
                            micro_batch_size=micro_batch_size, seed=seed, warmup_ratio=warmup_ratio,
                            scheduler=scheduler, log_every=max(1, steps), checkpoint_dir=None, bf16=bf16,
                            eager_attention_max_len=eager_attention_max_len)


def train_locally(model: torch.nn.Module, input_ids: list[list[int]], labels: list[int], pad_token_id: int, *,
                  steps: int, lr: float, batch_size: int, micro_batch_size: int | None, seed: int,
                  head_lr: float | None = None, proximal_mu: float = 0.0, bf16: bool = False,
                  eager_attention_max_len: int = 0, logit_adjustment: bool = False, scheduler: str = "constant",
                  warmup_ratio: float = 0.0, optimizer_state: dict | None = None) -> TrainResult:
    """`steps` optimizer steps of the project's loop on this client's examples (no checkpoints: a round is short and
    the server keeps every completed round); `proximal_mu` > 0 adds FedProx's proximal term to the loss. `bf16` and
    `eager_attention_max_len` are what the plan measured faster on the machine (the train stage's switches).

    `logit_adjustment`: the loss sees the head's logits plus the log of this client's label prior (logit
    adjustment, Menon et al. 2021, applied per client against label skew as in FedLC, Zhang et al. 2022). A client
    whose rows are mostly one label then does not have to learn "answer that label" to lower its loss, so its
    update moves the shared head toward the class-conditional evidence instead of toward its own prior, and
    clients of different label mixes stop pulling the averaged head back and forth. Only training sees the
    shift; the model's own logits (what the server evaluates and serves) are unchanged in form.

    A client's round is a constant learning rate (the default); the centralized baseline passes the train stage's
    schedule (`scheduler`, `warmup_ratio`). `head_lr`: the classification head's rate (None = `lr`), as the train
    stage gives its head, which starts untrained where the adapters start at zero.

    `optimizer_state`: AdamW's moments from this client's previous round, continued instead of restarted, and
    replaced by this round's on return (`federated.client_state: kept`; train_classifier says how)."""
    cfg = client_loop(steps=steps, lr=lr, head_lr=head_lr, batch_size=batch_size, micro_batch_size=micro_batch_size,
                      seed=seed, bf16=bf16, eager_attention_max_len=eager_attention_max_len, scheduler=scheduler,
                      warmup_ratio=warmup_ratio)
    regularizer = proximal_term(model, proximal_mu) if proximal_mu > 0 else None
    hook = None
    if logit_adjustment:
        head = head_module(model)
        prior = label_log_prior(labels, int(model.config.num_labels))
        hook = head.register_forward_hook(lambda _module, _inputs, output: output + prior.to(output.device,
                                                                                             output.dtype))
    try:
        return train_classifier(model, input_ids, labels, cfg, pad_token_id, progress=False, regularizer=regularizer,
                                optimizer_state=optimizer_state)
    finally:
        if hook is not None:
            hook.remove()


def sample_rows(labels: list[int], count: int, seed: int) -> list[int]:
    """Indices of `count` rows (all when `count` is 0 or not fewer), each label's share as in `labels` (largest
    remainders), drawn with `seed`, in their original order: the server's evaluation between rounds, the same rows
    after every round."""
    if not count or count >= len(labels):
        return list(range(len(labels)))
    by_label: dict[int, list[int]] = {}
    for index, label in enumerate(labels):
        by_label.setdefault(label, []).append(index)
    quotas = {label: count * len(rows) / len(labels) for label, rows in by_label.items()}
    taken = {label: int(quota) for label, quota in quotas.items()}
    for label in sorted(quotas, key=lambda k: (taken[k] - quotas[k], k))[:count - sum(taken.values())]:
        taken[label] += 1
    generator = np.random.default_rng(seed)
    chosen = [int(i) for label, rows in by_label.items()
              for i in generator.choice(rows, size=taken[label], replace=False)]
    return sorted(chosen)


def evaluation_split(test: tuple[list, list], number: int, num_rounds: int, rows: int, seed: int) -> tuple[list, list]:
    """What the server evaluates after round `number` of `num_rounds`: the whole test split (input ids, labels)
    after the last round, whose figure is the result; `rows` of it after the others (sample_rows: the same rows
    every round), which only draw the curve. `rows` 0: the whole split every round."""
    if number >= num_rounds or not rows:
        return test
    chosen = sample_rows(test[1], rows, seed)
    return [test[0][i] for i in chosen], [test[1][i] for i in chosen]


def evaluate(model: torch.nn.Module, input_ids: list[list[int]], labels: list[int], label_names: list[str],
             pad_token_id: int, batch_size: int = 32, bf16: bool = False) -> dict:
    """Accuracy, macro-F1 (frugaltune.metrics, as the evaluate stage) and the mean cross-entropy on a split, scored by
    the evaluate stage's evaluator (`frugaltune.classify`); `bf16`: under autocast, as the evaluate stage does where
    training ran in bf16."""
    scores = classify(model, input_ids, pad_token_id, batch_size, bf16, labels=labels)
    metrics = classification_metrics(np.asarray(labels), scores.predictions, label_names)
    return {"accuracy": metrics["accuracy"], "macro_f1": metrics["macro_f1"], "loss": round(scores.loss, 6)}
