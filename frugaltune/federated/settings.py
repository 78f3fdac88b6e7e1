"""A federation's settings, typed, and their one mapping to and from Flower's configs.

Library code, imported by the ServerApp and ClientApp (the Flower venv), the federated stage and the benchmark
(the project's venv); never run. It imports no Flower: a Flower config is a flat mapping of scalars, and this module
is the only place that turns it into typed settings (`from_flower`) or back (`to_flower`):

- `RunSettings`: the run config `flwr run --run-config` carries (out-dir, num-rounds, lr, ...). The keys and their
  defaults are also listed in flower_app/pyproject.toml, where Flower needs them; tests/unit/test_federated.py
  checks that file against these defaults, so the two cannot drift.
- `RoundSettings`: what the server sends each client with a round (its `config` record): the run's settings the
  client's training depends on, with the round's number and learning rate.
- `NodeSettings`: what one client machine owns (`--node-config`, or its entry of the simulation's node list).

A key is the field's name with `-` for `_`; lists travel as JSON strings (Flower's values are scalars).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

from frugaltune.federated import aggregation
from frugaltune.methods import MethodKnobs

Scalar = str | int | float | bool


def flower_key(name: str) -> str:
    return name.replace("_", "-")


def _json_list(value):
    """A list as Flower carries it (a JSON string) or as Python has it."""
    return json.loads(value) if isinstance(value, str) else value


class FlowerRecord(BaseModel):
    """Typed settings read from and written to a flat Flower config. Unknown keys are ignored (Flower adds its own,
    e.g. a simulated node's `partition-id` / `num-partitions`; SecAgg+ adds `secure-names`)."""

    model_config = ConfigDict(alias_generator=flower_key, populate_by_name=True, extra="ignore", frozen=True)

    @classmethod
    def from_flower(cls, config: Mapping[str, Scalar]):
        return cls.model_validate(dict(config))

    def to_flower(self) -> dict[str, Scalar]:
        """Every set field under its Flower key; lists as JSON, None left out (a Flower config has no null)."""
        return {key: json.dumps(list(value)) if isinstance(value, (list, tuple)) else value
                for key, value in self.model_dump(by_alias=True).items() if value is not None}


class ClientTraining(FlowerRecord):
    """The run's settings a client's training depends on: sent with every round, so a SuperNode needs no copy."""

    model_dir: str = "models/base"
    labels: tuple[str, ...] = ()
    pad_token_id: int = 0
    method: Literal["fedavg", "ffa"] = "fedavg"
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    local_steps: int = 4
    lr: float = 0.0002
    head_lr: float = 0.0  # the head's rate (0 = lr); a round's is scaled by the round's decay as lr is
    batch_size: int = 8
    seed: int = 42
    dp_epsilon: float = 0.0  # 0 = no differential privacy; > 0: clip the update to dp_clip and add Gaussian noise
    dp_delta: float = 0.00001
    dp_clip: float = 1.0
    proximal_mu: float = 0.0  # FedProx: > 0 adds mu/2 * ||w - w_global||^2 to each client's loss
    transmit_dtype: Literal["fp32", "bf16"] = "fp32"  # bf16 sends each tensor as its 16-bit pattern
    logit_adjustment: bool = False  # clients train on logits + log(own label prior) (local.train_locally)
    client_state: Literal["fresh", "kept"] = "fresh"  # kept: AdamW's moments continue (needs the node's state-dir)

    _lists = field_validator("labels", "lora_target_modules", mode="before")(_json_list)

    def lora(self) -> MethodKnobs:
        """The global adapter's LoRA settings (the flat `lora-*` keys are what Flower's run config carries)."""
        return MethodKnobs(self.lora_r, self.lora_alpha, self.lora_dropout, tuple(self.lora_target_modules))


class RoundSettings(ClientTraining):
    """A round's settings as a client receives them: `lr` is already the round's (RunSettings.round_lr)."""

    round: int = 1


class RunSettings(ClientTraining):
    """The run config of a federation (the ServerApp's `context.run_config`)."""

    out_dir: str = "checkpoints/federated/run"
    test_data: str = "data/federated/test.parquet"
    num_rounds: int = 3
    fraction: float = 0.5
    min_clients: int = 2
    min_completed: int = 1
    node_timeout: float = 120.0
    round_timeout: float = 600.0
    server_lr: float = 1.0  # the global moves server-lr times the clients' mean update (1 = plain FedAvg)
    server_momentum: float = 0.0  # FedAvgM: the global moves along v = momentum * v + mean update (0 = none)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # the clients' lr across the rounds
    eval_batch_size: int = 32
    round_eval_rows: int = 0  # rows of the test split evaluated after each round but the last (0 = all of them)
    # after this round the server waits for the stage's replan (rounds.replan_path) before the next: the rounds the
    # federation ends with, its lr decay re-laid over them from the next round on (0 = no replan)
    replan_after: int = 0
    threads: int = 1  # the server's evaluation
    secure_aggregation: bool = False  # SecAgg+: the server sees only the weighted mean of the updates
    secure_max_weight: float = 1000.0  # SecAgg+: the largest num_examples of a client (weights quantized by it)
    precision: Literal["fp32", "bf16"] = "fp32"  # the server's evaluation (the clients': their node settings)
    simulation_nodes: str = ""  # Simulation Engine: a JSON file of the virtual nodes' NodeSettings, by partition-id
    # a folder the stage gives the federations of one base, test split and round code: round 0's evaluation is kept
    # there under the start's bytes, and a federation with the same start reads it instead of evaluating it again
    start_evaluations: str = ""

    def round_lr(self, number: int) -> float:
        """The clients' lr in round `number`: the decay of centralized training across the rounds, or `lr`."""
        return aggregation.round_lr(self.lr, number, self.num_rounds, self.lr_schedule)

    def for_round(self, number: int) -> RoundSettings:
        shared = self.model_dump(include=set(ClientTraining.model_fields))
        lr = self.round_lr(number)
        return RoundSettings(**{**shared, "lr": lr, "head_lr": self.head_lr * lr / self.lr}, round=number)


class NodeSettings(FlowerRecord):
    """What one client machine owns and decided (its plan): its rows never leave it. Unset = the run's value."""

    data: str | None = None  # its tokenized rows (parquet: input_ids, labels)
    model_dir: str | None = None  # its copy of the base model (default: the server's path)
    lora_rank: int | None = None  # <= the global rank (default: the global rank)
    micro_batch: int | None = None
    local_steps: int | None = None  # its plan's (a round budget may lower them)
    threads: int = 1
    client_id: int | None = None  # which client of the plan it is (the server samples by it)
    partition_id: int | None = None  # Flower's, under the Simulation Engine
    precision: Literal["fp32", "bf16"] = "fp32"
    eager_attention_max_len: int = 0
    int8_products: bool = False  # its frozen products in int8 (frugaltune/int8.py): what its plan measured faster
    state_dir: str | None = None  # where it keeps AdamW's moments between rounds (client_state: kept)
