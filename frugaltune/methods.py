"""The method registry: every training method once, as the facts the rest of the code reads instead of its name.

Library code, no entry point. `train.method`'s choices (frugaltune/config/training.py), `compare.methods`,
`frugaltune plan --method`, the planner (shapes, memory, FLOPs, the calibration's order), int8 products, the
learning rate (frugaltune/training/setup.py), the model's preparation and freezing (frugaltune/training/methods.py,
which carries out `trains`, `dora` and `quantized_base`), the train recipe and the federated clients all look a
method up here (`get`) and read its facts; none of them branches on a method's name. It imports nothing of the
project, so that every layer may import it (the params schema included). Adding a method: docs/METHODS.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# What a method trains, which frugaltune/training/methods.py carries out (`prepare_model`, `freeze_for`):
# nothing (the base model evaluated as it is), every parameter, the input (and learned position) embeddings and the
# head, or low-rank adapters on `train.<method>.target_modules` and the head (peft, which saves them).
Trains = Literal["nothing", "everything", "embeddings", "adapters"]


@dataclass(frozen=True)
class MethodKnobs:
    """The LoRA settings, in the one shape the code passes around: `train.lora` / `train.dora` / `train.qlora`
    (`LoraParams.knobs()`), `federated.lora` (the global adapter; its clients' ranks are smaller) and what the
    planner prices. `quant_type` and `double_quant` are QLoRA's 4-bit base; the other methods ignore them, and
    methods without adapters ignore all of it."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.05
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    quant_type: str = "nf4"
    double_quant: bool = True
    last_layers: int | None = None


@dataclass(frozen=True)
class Method:
    """One training method. Its knobs are the params section `train.<name>` (a `LoraParams` when it trains
    adapters, a `QloraParams` with a quantized base, an `lr` when `own_lr`)."""

    name: str
    trains: Trains
    # training FLOPs per token relative to the matmul parameter count N: forward 2N, backward 2N for the input
    # gradients, +2N for the weight gradients when every weight trains; inference alone 2N
    flops_factor: float
    # the calibration times the methods it was not configured with in this order while its budget lasts: those
    # whose training FLOPs (the fallback) are furthest from their measured cost first (docs/DECISIONS.md, "A
    # calibration under a tenth of the run")
    timing_order: int = 0
    dora: bool = False  # weight-decomposed adapters (peft `use_dora`): its forward reads the frozen weight's norm
    quantized_base: bool = False  # the decoder's linear weights in 4 bit (bitsandbytes), placed by bitsandbytes
    # `train.int8_products: auto` may turn int8 products on (frugaltune/int8.py): measured to keep its quality
    int8_auto: bool = False
    own_lr: bool = False  # its body trains at `train.<name>.lr` (null = `train.lr`), not at `train.lr`
    # trained in bf16, its frozen decoder projections are stored in bf16 once (frugaltune/training/fast.py)
    frozen_bf16: bool = False

    @property
    def trained(self) -> bool:
        """Whether anything trains: a method that trains nothing is evaluated as it is (no steps, no loss)."""
        return self.trains != "nothing"

    @property
    def adapters(self) -> bool:
        """Low-rank adapters (peft): LoRA knobs, peft saves and loads them."""
        return self.trains == "adapters"


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("none", trains="nothing", flops_factor=2.0),
    Method("full", trains="everything", flops_factor=6.0, timing_order=0, own_lr=True),
    Method("lora", trains="adapters", flops_factor=4.0, timing_order=4, int8_auto=True, frozen_bf16=True),
    Method("qlora", trains="adapters", flops_factor=4.0, timing_order=2, quantized_base=True),
    Method("prelayer", trains="embeddings", flops_factor=4.0, timing_order=1, own_lr=True),
    Method("dora", trains="adapters", flops_factor=4.0, timing_order=3, dora=True, int8_auto=True),
)}
NAMES: tuple[str, ...] = tuple(METHODS)  # `train.method`'s choices, in the order the plan and the tables list them
TRAINED: tuple[str, ...] = tuple(name for name, m in METHODS.items() if m.trained)


def get(name: str) -> Method:
    """The method called `name`; ValueError naming the choices for any other name."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; methods: {', '.join(NAMES)}") from None


def timing_order(names) -> list[str]:
    """`names` in the order the calibration times them (`Method.timing_order`)."""
    return sorted(names, key=lambda name: get(name).timing_order)
