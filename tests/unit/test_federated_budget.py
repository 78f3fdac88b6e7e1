"""The federated stage on a time budget (frugaltune/federated/budget.py): a client-round is measured on this machine
with the planner's calibration of a tiny model, every round of the federation is predicted from it, and a smaller
budget runs fewer rounds, the decision saying what was traded.
Run with `pytest tests/unit/test_federated_budget.py` (no Flower needed; a few seconds of calibration)."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from frugaltune.config import parse_params
from frugaltune.federated import budget

CLIENTS = 3


def rows(n: int, seed: int) -> pa.Table:
    rng = random.Random(seed)
    ids = [[rng.randrange(5, 400) for _ in range(rng.randrange(6, 20))] for _ in range(n)]
    return pa.table({"input_ids": ids, "labels": [i % 3 for i in range(n)]})


@pytest.fixture(scope="module")
def federation_data(tmp_path_factory):
    data = tmp_path_factory.mktemp("federated")
    parts = data / "partitions_iid"
    parts.mkdir()
    for client in range(CLIENTS):
        pq.write_table(rows(24, client), parts / f"client_{client}.parquet")
    (parts / "partitions.json").write_text(json.dumps({"clients": [{"client": c} for c in range(CLIENTS)]}))
    pq.write_table(pa.concat_tables([rows(24, c) for c in range(CLIENTS)]), data / "train.parquet")
    pq.write_table(rows(30, 99), data / "test.parquet")
    return data


def decide(data, model_dir, pad_token_id: int, minutes: float) -> dict:
    params = parse_params({"common": {"seed": 0}, "federated": {
        "num_clients": CLIENTS, "partition": "iid", "methods": ["fedavg"], "iid_control": False, "num_rounds": 6,
        "fraction": 0.7, "min_completed": 2, "local_steps": 3, "batch_size": 4, "lora": {"r": 4, "alpha": 8},
        "threads": 1, "budget_minutes": minutes}})
    plans = {"iid": [{"client": c, "fits": True, "lora_rank": 4, "micro_batch_size": None, "local_steps": 3,
                      "examples": 24} for c in range(CLIENTS)]}
    return budget.decide(params, plans, [("iid", "fedavg")], ["a", "b", "c"], pad_token_id, (False, 0), 0.0, data,
                         model_dir)


def test_a_smaller_budget_runs_fewer_rounds_and_says_what_was_traded(federation_data, tiny_model_dir,
                                                                     smol_tokenizer):
    roomy = decide(federation_data, tiny_model_dir, smol_tokenizer.pad_token_id, minutes=600)
    assert roomy["rounds"] == 6 and roomy["fits"] and roomy["trade"].startswith("6 rounds asked, all fit in 600 min")
    # measured here, by the clients' own loop: a positive time per token, and each round's clients as sampled
    assert roomy["calibration"]["seconds_per_token"] > 0 and "calibrated" in roomy["calibration"]["source"]
    # and the server's evaluation from the same process's timed forward passes over the test split's batches
    timed = roomy["calibration"]["evaluation"]
    assert len(timed["batches"]) == 3 and all(b["seconds"] > 0 and b["padded_tokens"] > 0 for b in timed["batches"])
    assert timed["seconds_per_token"] > 0 and roomy["evaluation_seconds"] >= 0  # a tiny model's rounds to 0.00 s
    predicted = roomy["runs"]["fedavg_iid"]
    assert [r["round"] for r in predicted] == [1, 2, 3, 4, 5, 6]
    # a round: its clients' training, then the server's evaluation (a tiny model's rounds to 0.00 s on a fast CPU)
    assert all(len(r["clients"]) == 3 and r["training_seconds"] > 0 for r in predicted)
    assert all(r["seconds"] == pytest.approx(r["training_seconds"] + roomy["evaluation_seconds"], abs=0.011)
               for r in predicted)
    assert roomy["per_round_seconds"][0] > predicted[0]["seconds"]  # the centralized reference's share on top

    # a budget with room for two of the six rounds, on this measurement
    two = roomy["spent_before_rounds_s"] + roomy["evaluation_seconds"] + sum(roomy["per_round_seconds"][:2]) + 1e-3
    chosen = budget.choose_rounds(6, two, roomy["spent_before_rounds_s"], roomy["evaluation_seconds"],
                                  roomy["per_round_seconds"])
    assert chosen["rounds"] == 2 and chosen["fits"]
    assert chosen["trade"].startswith(f"6 rounds asked, 2 fit in {two / 60:g} min")

    # a budget nothing fits: one round still runs, and the decision says it will not fit
    tight = decide(federation_data, tiny_model_dir, smol_tokenizer.pad_token_id, minutes=0.0001)
    assert tight["rounds"] == 1 and not tight["fits"] and "not even 1 fits" in tight["trade"]
    assert len(tight["runs"]["fedavg_iid"]) == 1


def test_no_budget_runs_every_round_asked_without_measuring():
    params = parse_params({"federated": {"num_rounds": 4, "budget_minutes": None}})
    assert budget.decide(params, {}, [], [], 0, (False, 0), 0.0, None, None) == {
        "minutes": None, "rounds_asked": 4, "rounds": 4, "trade": "no budget: 4 rounds"}


def test_clients_run_longest_first_on_the_first_free_worker():
    assert budget.makespan([3.0, 1.0, 2.0], workers=1) == 6.0
    assert budget.makespan([3.0, 1.0, 2.0], workers=2) == 3.0
    assert budget.makespan([], workers=2) == 0.0
