"""The training loop's settings (`LoopConfig`), grouped by concern, and their one builder, `LoopConfig.build`.

Library code, no entry point. Nothing else constructs a LoopConfig or its groups (tests/unit/test_training.py checks
frugaltune/, stages/, flows/ and benchmarks/): the values come from the run's params through
`training.setup.loop_config` (the train recipe, the compare stage, the plan's calibration, the federated
centralized reference), from a federated client's round through `federated.local.client_loop` (the clients and
the budget's calibration of them), or back from the serialized form `to_dict` (what the calibration's process
receives). Each setting keeps one name everywhere, the name `train.*` gives it in params.yaml where it has one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from frugaltune.training.inference import SHARED_PREFIX_MIN


@dataclass(frozen=True)
class Optimization:
    """What a step does with its gradients: AdamW's rates and decay, the schedule, clipping."""

    lr: float
    head_lr: float | None = None  # the head's rate; None: lr
    # LoRA+ (Hayou et al. 2024): B's rate = ratio x lr; B starts at zero and its gradient is A-scaled, so at one
    # shared rate it moves too slowly for its role (peft's create_loraplus_optimizer does the same grouping)
    lora_plus_ratio: float = 1.0
    weight_decay: float = 0.0
    scheduler: str = "linear"
    warmup_ratio: float = 0.05
    max_grad_norm: float = 1.0
    head_names: tuple[str, ...] = ("score",)  # parameters whose name contains one of these train at head_lr


@dataclass(frozen=True)
class Batching:
    """Which rows make a step, in how many passes, and how many steps the run takes."""

    batch_size: int = 16
    grad_accum: int = 1
    micro_batch_size: int | None = None  # None = batch_size; smaller: each batch runs in parts (same gradient)
    # A part's padded tokens at most (rows x the batch's longest row): a wider batch runs in as few equal parts as
    # keep under it, accumulated like micro_batch_size's. None: no cap. Length-grouped batches are mostly short, so
    # this bounds the peak memory that the few long ones set, at the cost of splitting only those.
    micro_batch_tokens: int | None = None
    group_by_length: bool = True
    epochs: float = 1.0
    max_steps: int | None = None  # set: the run's steps, whatever `epochs` says


@dataclass(frozen=True)
class Checkpoints:
    """Where and how often the loop writes the checkpoints it resumes from."""

    checkpoint_dir: Path | None = None  # None: no checkpoints
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    resume: bool = True


@dataclass(frozen=True)
class Speed:
    """How a step is computed, not what (the same update to rounding): the precision and attention crossover the
    plan decides for the machine, and the loop's own faster paths."""

    bf16: bool = False
    # Batches padded to at most this many tokens use eager attention, longer ones SDPA (0: SDPA always); the
    # crossover is measured by the kernels stage and resolved by the plan (frugaltune.training.fast)
    eager_attention_max_len: int = 0
    # causal_lm: a batch whose rows start with at least this many equal tokens reads them once (model_loss's
    # `shared`); 0: never. Off by itself under gradient checkpointing, which cannot carry a KV cache.
    shared_prefix_min: int = SHARED_PREFIX_MIN
    # AdamW as one fused kernel over every trainable tensor (torch's `fused=True`, CPU and CUDA) instead of the
    # per-tensor loop: LoRA has ~240 small tensors, so the loop is dispatch, not arithmetic. Same update to
    # rounding; measured faster on every machine tried (docs/DECISIONS.md, benchmarks/step_anatomy.py --ab optimizer)
    fused_optimizer: bool = True
    # LoRA layers over int8 frozen products run as one autograd node per product (q/k/v, gate/up, o, down): one
    # dropout, one cast, A's products stacked, B's added in addmm (frugaltune.training.fast.fused_int8_lora); a model without
    # int8 products has nothing it takes. Measured faster in paired steps (docs/DECISIONS.md,
    # benchmarks/step_anatomy.py --ab-paired 60 --ab int8lora)
    fused_int8_lora: bool = True


@dataclass(frozen=True)
class Reporting:
    """What the run says while it trains."""

    log_every: int = 10  # steps per logged record (history, on_log, the bar's loss)
    # Where the output is not a terminal (a log file, a pipe), one progress line every this many seconds of wall
    # time (step/total, loss, tokens/s, ETA), flushed: a bar there is `\r` redraws, or nothing when bars are off
    progress_every_s: float = 30.0


_GROUPS = {"optim": Optimization, "batching": Batching, "checkpoints": Checkpoints, "speed": Speed,
           "reporting": Reporting}
_GROUP_OF = {f.name: group for group, kind in _GROUPS.items() for f in fields(kind)}


@dataclass(frozen=True)
class LoopConfig:
    """The training loop's settings by concern; `seed` (the data order and the dropout masks) stands alone.
    Made by `build` only."""

    optim: Optimization
    batching: Batching
    checkpoints: Checkpoints
    speed: Speed
    reporting: Reporting
    seed: int = 42

    @classmethod
    def build(cls, **settings: Any) -> LoopConfig:
        """The one builder: each setting by its name (`lr`, `batch_size`, `checkpoint_dir`, `bf16`, ...; `lr` is
        required), put in its group; the rest keep their defaults. Takes `to_dict`'s form back (JSON's list of head
        names, a path as a string)."""
        unknown = sorted(set(settings) - set(_GROUP_OF) - {"seed"})
        if unknown:
            raise TypeError(f"LoopConfig.build: no setting {', '.join(unknown)} (the settings: "
                            f"{', '.join(sorted(_GROUP_OF))}, seed)")
        if "lr" not in settings:
            raise TypeError("LoopConfig.build: `lr` is required")
        if "head_names" in settings:
            settings["head_names"] = tuple(settings["head_names"])
        if settings.get("checkpoint_dir") is not None:
            settings["checkpoint_dir"] = Path(settings["checkpoint_dir"])
        grouped: dict[str, dict[str, Any]] = {group: {} for group in _GROUPS}
        for name, value in settings.items():
            if name != "seed":
                grouped[_GROUP_OF[name]][name] = value
        return cls(**{group: kind(**grouped[group]) for group, kind in _GROUPS.items()},
                   **({"seed": settings["seed"]} if "seed" in settings else {}))

    def to_dict(self) -> dict[str, Any]:
        """Every setting by its one name, in JSON's types (a path as a string): `build(**cfg.to_dict()) == cfg`
        after a JSON round trip too. The calibration's process receives its LoopConfig in this form."""
        flat: dict[str, Any] = {"seed": self.seed}
        for group in _GROUPS:
            part = getattr(self, group)
            flat.update({f.name: getattr(part, f.name) for f in fields(part)})
        flat["head_names"] = list(flat["head_names"])
        if flat["checkpoint_dir"] is not None:
            flat["checkpoint_dir"] = str(flat["checkpoint_dir"])
        return flat
