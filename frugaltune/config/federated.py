"""Params sections of federated fine-tuning on Flower: `federated` and its `dp` switch.

Library code, no entry point: imported through `frugaltune.config`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from frugaltune.config.base import Section
from frugaltune.config.training import LoraParams


class FederatedDpParams(Section):
    """Client-side differential privacy of each round's update (frugaltune/federated/privacy.py)."""
    enabled: bool = Field(False, description="Clip each client's update to `clipping_norm` and add Gaussian noise.")
    clipping_norm: float = Field(1.0, gt=0, description="L2 bound of one client's update (adapter + head).")
    epsilon: float = Field(10.0, gt=0, description="Per-round privacy budget: smaller = more noise. Not accounted "
                           "across rounds: a client in k rounds spends about k times this.")
    delta: float = Field(1e-5, gt=0, lt=1, description="Failure probability of the Gaussian mechanism.")


class FederatedParams(Section):
    """`federated.*`: federated fine-tuning on Flower (stages/federated.py; README "Federated fine-tuning")."""
    num_clients: int = Field(10, ge=2, description="Clients the training split is partitioned into (one SuperNode "
                             "each). With partition `column`: one per distinct value instead.")
    partition: Literal["iid", "dirichlet", "column"] = Field(
        "dirichlet", description="iid: random equal shares; dirichlet: label skew Dir(alpha) per client; column: "
        "one client per value of `partition_by` (a natural owner id).")
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration: smaller = each client sees fewer labels.")
    partition_by: str | None = Field(None, description="The column naming each row's owner (partition `column`).")
    methods: list[Literal["fedavg", "ffa"]] = Field(
        ["fedavg", "ffa"], min_length=1, description="Aggregations compared on the same partitions: fedavg averages "
        "A, B and the head (inexact for LoRA); ffa freezes A at the shared seeded init and averages B (exact).")
    iid_control: bool = Field(True, description="Also run the first method on an IID partition, as a control.")
    centralized_baseline: bool = Field(True, description="Also train LoRA centrally (one process, the whole "
                                       "training split) on as many examples as the first run's clients trained on, "
                                       "with the same LoRA, lr, batch and seed, on the same test split: the "
                                       "reference for each run's macro-F1 gap.")
    num_rounds: int = Field(3, ge=1, description="Federated rounds asked (`budget_minutes` may run fewer).")
    budget_minutes: float | None = Field(
        40, gt=0, description="Wall time the whole stage may take: the plan measures a client-round on this machine "
        "and runs as many of `num_rounds` as fit, the report saying what was traded "
        "(frugaltune/federated/budget.py). null = every round asked, however long.")
    round_eval_rows: int | None = Field(
        None, ge=1, description="Rows of the test split the server evaluates after every round but the last: a "
        "fixed sample, label-stratified and seeded (local.sample_rows). The last round, the result, and round 0 "
        "are evaluated on the whole split. Only the last round's figure is a result; the others draw the curve, "
        "and the budget buys rounds with the time saved. null = the whole split after every round.")
    fraction: float = Field(0.5, gt=0, le=1, description="Share of the connected clients sampled each round.")
    min_completed: int = Field(2, ge=1, description="Completion floor: a round counts when at least this many "
                               "sampled clients reply; failed or late clients are left out of its average.")
    round_timeout_s: float = Field(900, gt=0, description="Seconds a round waits for replies before it closes.")
    local_steps: int = Field(8, ge=1, description="Optimizer steps per client per round (the planner may lower it "
                             "to fit `round_budget_s`).")
    round_budget_s: float | None = Field(None, gt=0, description="Seconds a client may spend training in a round; "
                                         "null = no time cap (plans without calibration cannot estimate time).")
    lr: float = Field(5e-4, gt=0, description="Clients' learning rate (constant within a round).")
    head_lr: float | None = Field(None, gt=0, description="The clients' rate for the classification head, which "
                                  "starts untrained (the train stage's `head_lr`); it follows `lr_schedule` as `lr` "
                                  "does. null = `lr`.")
    server_lr: float = Field(1.0, gt=0, description="Server learning rate: the next global adapter is global + "
                             "server_lr * (aggregate - global) (FedAvg with server SGD, Reddi et al. 2021). 1 = plain "
                             "FedAvg/FFA; > 1 makes up for clients that each move only their own local steps' worth "
                             "per round (aggregation.server_step).")
    server_momentum: float = Field(0.0, ge=0, lt=1, description="FedAvgM: the server steps along v = momentum * v "
                                   "+ (aggregate - global), which averages the rounds' label-skewed leanings "
                                   "(aggregation.server_momentum_step); 0 = none.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="The clients' lr across rounds: constant, or centralized training's decay sampled "
        "mid-round (aggregation.round_lr).")
    batch_size: int = Field(8, ge=1, description="Clients' batch size (the plan may split it into micro-batches).")
    lora: LoraParams = Field(default_factory=LoraParams, description="The global adapter: clients use rank <= r, "
                             "alpha scaled to keep alpha/r.")
    profiles: list[Literal["laptop", "small_cpu_box", "gpu_server"]] = Field(
        ["laptop", "small_cpu_box", "gpu_server"], min_length=1, description="Hardware presets assigned to the "
        "clients in turn (frugaltune/federated/profiles.py): each is planned for its own memory and cores.")
    threads: int = Field(1, ge=1, description="Threads of each client process on this machine (simulation: all "
                         "clients share this host).")
    runtime: Literal["simulation", "deployment"] = Field(
        "simulation", description="How the stage runs the federation on this machine: simulation = Flower's "
        "Simulation Engine (virtual SuperNodes on long-lived Ray workers, one per core, each building the model "
        "once); deployment = a SuperLink and one SuperNode process per client on loopback, as across machines "
        "(every client-round starts a fresh ClientApp process).")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="Clients' training and the server's evaluation on this machine: auto = what the kernels "
        "stage measured faster here (as train.precision: auto).")
    dp: FederatedDpParams = Field(default_factory=FederatedDpParams, description="Differential privacy switch.")
    logit_adjustment: bool = Field(False, description="Clients train on logits + log(their own label prior) "
                                   "(Menon et al. 2021; per client as in FedLC): under label skew each client's "
                                   "update stops pulling the shared head toward its own majority label. The prior "
                                   "never leaves the client; the served model's logits are unchanged in form.")
    proximal_mu: float = Field(0.0, ge=0, description="FedProx: each client adds mu/2 * ||w - w_global||^2 over its "
                               "trainable tensors to its loss, pulling its update toward the global adapter (helps "
                               "with skewed data and many local steps; typical 0.001-1). 0 = off (plain FedAvg/FFA).")
    client_state: Literal["fresh", "kept"] = Field(
        "fresh", description="fresh: each client starts every round with a new AdamW (zero moments); kept: it "
        "continues the moments and step count it ended its previous round with, kept on its own disk (a "
        "SuperNode's `state-dir`). Nothing of it travels.")
    transmit_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="Precision of the tensors on the wire, both ways: bf16 halves the bytes (each value "
        "rounded to 8 significant bits); each round starts from the bf16-rounded global the clients receive.")
    secure_aggregation: bool = Field(
        False, description="SecAgg+ (Flower's protocol): clients mask their updates so that the server learns only "
        "their example-weighted mean, never one client's tensors. Four exchanges per round instead of one; needs >= 2 "
        "clients per round; values are quantized (small error). Uploads travel fp32 whatever transmit_dtype says.")

    @model_validator(mode="after")
    def _check_lora(self) -> "FederatedParams":
        if self.lora.last_layers is not None:  # the clients' adapters and the aggregation assume every layer
            raise ValueError("federated.lora.last_layers: the federated stage adapts every decoder layer; remove the "
                             "key or set it to null (train.lora.last_layers is the centralized switch)")
        return self
