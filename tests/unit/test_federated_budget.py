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
from frugaltune.federated.plans import Precision
from frugaltune.planner.machine import decide_machine

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


def decide(data, model_dir, pad_token_id: int, minutes: float, eval_rows: int | None = None) -> dict:
    params = parse_params({"common": {"seed": 0}, "federated": {
        "num_clients": CLIENTS, "partition": "iid", "methods": ["fedavg"], "iid_control": False, "num_rounds": 6,
        "fraction": 0.7, "min_completed": 2, "local_steps": 3, "batch_size": 4, "lora": {"r": 4, "alpha": 8},
        "threads": 1, "budget_minutes": minutes, "round_eval_rows": eval_rows}})
    plans = {"iid": [{"client": c, "fits": True, "lora_rank": 4, "micro_batch_size": None, "local_steps": 3,
                      "examples": 24} for c in range(CLIENTS)]}
    # no plan here: the cores as the plan's entry point counts them on this machine
    return budget.decide(params, plans, [("iid", "fedavg")], ["a", "b", "c"], pad_token_id, Precision(False, 0), 0.0,
                         data, model_dir, decide_machine({}, None)["cores"])


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
    assert roomy["reference_seconds"][0] > 0 and roomy["per_round_seconds"][0] == pytest.approx(
        sum(found[0]["seconds"] for found in roomy["runs"].values()) + roomy["reference_seconds"][0], abs=0.03)

    # a budget with room for two of the six rounds, on this measurement
    two = roomy["spent_before_rounds_s"] + roomy["evaluation_seconds"] + sum(roomy["per_round_seconds"][:2]) + 1e-3
    chosen = budget.choose_rounds(6, two, roomy["spent_before_rounds_s"], roomy["evaluation_seconds"],
                                  roomy["per_round_seconds"])
    assert chosen["rounds"] == 2 and chosen["fits"]
    assert chosen["trade"].startswith(f"6 rounds asked, 2 fit in {two / 60:g} min")

    assert roomy["evaluation_rows"] == 30  # every round evaluates the whole test split
    # a budget nothing fits: one round still runs, and the decision says it will not fit. Rounds before the last
    # evaluate 10 of the 30 test rows: priced per round; each federation's last round the whole split on top
    tight = decide(federation_data, tiny_model_dir, smol_tokenizer.pad_token_id, minutes=0.0001, eval_rows=10)
    assert tight["rounds"] == 1 and not tight["fits"] and "not even 1 fits" in tight["trade"]
    assert tight["evaluation_rows"] == 10 and tight["last_evaluation_extra_s"] >= 0
    assert len(tight["runs"]["fedavg_iid"]) == 1


def test_no_budget_runs_every_round_asked_without_measuring():
    params = parse_params({"federated": {"num_rounds": 4, "budget_minutes": None}})
    assert budget.decide(params, {}, [], [], 0, Precision(False, 0), 0.0, None, None) == {
        "minutes": None, "rounds_asked": 4, "rounds": 4, "trade": "no budget: 4 rounds"}


def test_a_stopped_calibration_runs_every_round_asked_and_says_why(federation_data, monkeypatch):
    """A busy or stalled machine stops the client-round's calibration (CalibrationStopped, raised here where
    the real one would be, tests/faults/test_busy_machine.py shows how): no traceback, no budget, and the reason."""
    from frugaltune.planner.worker import CalibrationStopped

    def stopped(*args, **kwargs):
        raise CalibrationStopped("its process got no CPU for 30 s (the machine is busy)")

    monkeypatch.setattr(budget, "measure_client_round", stopped)
    found = decide(federation_data, None, 0, minutes=5)
    assert found["minutes"] is None and found["rounds"] == found["rounds_asked"] == 6
    assert found["trade"] == ("6 rounds asked, all run: the budget of 5 min is not applied, the calibration stopped "
                              "early: its process got no CPU for 30 s (the machine is busy) (rerun the stage on a "
                              "quieter machine for a budget)")


def test_clients_run_longest_first_on_the_first_free_worker():
    assert budget.makespan([3.0, 1.0, 2.0], workers=1) == 6.0
    assert budget.makespan([3.0, 1.0, 2.0], workers=2) == 3.0
    assert budget.makespan([], workers=2) == 0.0


def planned(rounds: int = 6) -> dict:
    """A decision as `decide` makes it: three federations of 20 s of clients + 5 s of evaluation a round, and the
    centralized reference's 10 s share of each round, in a 10-minute budget, 30 s spent before the rounds."""
    runs = {name: [{"round": n, "clients": [0, 1], "training_seconds": 20.0, "seconds": 25.0, "steps": 8}
                   for n in range(1, rounds + 1)] for name in ("fedavg_dirichlet", "ffa_dirichlet", "fedavg_iid")}
    return {"minutes": 10.0, "rounds_asked": 10, "rounds": rounds, "predicted_seconds": 555.0, "fits": True,
            "trade": "10 rounds asked, 6 fit", "evaluation_seconds": 5.0, "per_round_seconds": [85.0] * rounds,
            "reference_seconds": [10.0] * rounds, "runs": runs}


def measured(*paces: tuple[float, float]) -> list[dict]:
    """Rounds 1, 2, ... as their JSONs say: (the clients' round_seconds, the server's evaluation_seconds)."""
    return [{"round": n, "round_seconds": t, "evaluation_seconds": e} for n, (t, e) in enumerate(paces, start=1)]


def test_the_first_rounds_as_predicted_keep_the_rounds_it_runs():
    found = budget.replan(planned(), "fedavg_dirichlet", measured((20.0, 5.0), (20.0, 5.0)),
                          opening_s=7.5, start_evaluation_s=5.0, launched_s=30.0, now_s=60.0)
    # 30 s spent + the first start of 7.5 s (2.5 s of Flower's start-up, and round 0's 5 s of evaluation) + 2 starts
    # of 2.5 s (round 0's evaluation is shared) + 3 ends priced as the start-up + 6 rounds of 85 s: 560 s
    assert found["rounds"] == 6 and not found["cut"] and found["fits"]
    assert found["predicted_seconds"] == pytest.approx(560.0) and found["closing_seconds"] == 2.5
    assert found["training_scale"] == 1.0 and found["evaluation_scale"] == 1.0
    assert "the 6 rounds fit in 10 min, predicted 9.3 min" in found["trade"]
    assert found["after_round"] == 2 and [p["round"] for p in found["paces"]] == [1, 2]
    assert "rounds 1 and 2 (1.00x" in found["trade"] and "slowest" not in found["trade"]


def test_slower_first_rounds_end_the_federations_with_the_rounds_that_fit_keeping_those_run():
    found = budget.replan(planned(), "fedavg_dirichlet", measured((40.0, 7.5), (40.0, 7.5)),
                          opening_s=20.0, start_evaluation_s=7.5, launched_s=30.0, now_s=100.0)
    assert found["training_scale"] == 2.0 and found["evaluation_scale"] == 1.5
    # a round is now 3 x (40 + 7.5) + 2 x 10 (the reference's share, scaled as the clients' training) = 162.5 s;
    # each other start and each end 12.5 s (the first start less round 0's evaluation, which the others read).
    # 30 s spent + the first start of 20 s + 2 starts and 3 ends of 12.5 s: 112.5 s, then 162.5 s a round. Nothing
    # is thrown away (the first federation's rounds 1 and 2 count): 3 rounds end at 600 s, the budget
    assert found["cut"] and found["rounds"] == 3 and found["fits"]
    assert found["predicted_seconds"] == pytest.approx(600.0)
    assert found["per_round_seconds"] == [162.5, 162.5, 162.5]
    assert [r["seconds"] for r in found["runs"]["fedavg_iid"]] == [47.5, 47.5, 47.5]
    assert found["trade"].endswith("3 of 6 rounds fit in 10 min (predicted 10.0 min); fedavg_dirichlet ends with "
                                   "round 3, the rounds after 2 at the lr of a 3-round federation")
    # the stage's report: the final decision on top, the first one kept, each round's prediction the new one
    report = budget.with_replan(planned(), found)
    assert report["rounds"] == 3 and report["initial"]["rounds"] == 6 and report["replan"]["cut"]
    assert report["runs"]["fedavg_dirichlet"][0]["seconds"] == 47.5 and "runs" not in report["replan"]


def test_each_federations_last_round_is_priced_with_the_whole_splits_evaluation(tmp_path):
    """round_eval_rows: rounds before the last evaluate a sample (the 5 s a round above); each federation's last
    round evaluates the whole split, 10 s more, scaled as round 1's evaluation was."""
    decision = {**planned(), "last_evaluation_extra_s": 10.0}
    found = budget.replan(decision, "fedavg_dirichlet", measured((20.0, 5.0), (20.0, 5.0)),
                          opening_s=7.5, start_evaluation_s=5.0, launched_s=30.0, now_s=60.0)
    assert found["predicted_seconds"] == pytest.approx(560.0 + 3 * 10.0) and found["rounds"] == 6
    slower = budget.replan(decision, "fedavg_dirichlet", measured((20.0, 7.5), (20.0, 7.5)),
                           opening_s=7.5, start_evaluation_s=5.0, launched_s=30.0, now_s=60.0)
    assert slower["last_evaluation_extra_s"] == 15.0  # 1.5x the evaluation
    assert budget.with_replan(decision, slower)["last_evaluation_extra_s"] == 15.0
    # the report: the last round's prediction carries the whole split's evaluation
    out = tmp_path / "run"
    (out / "rounds").mkdir(parents=True)
    for number in (0, 1, 2):
        (out / "rounds" / f"round_{number:03d}.json").write_text(json.dumps(
            {"round": number, "round_seconds": 20.0, "evaluation_seconds": 5.0 if number < 2 else 15.0}))
    predicted = [{"round": n, "seconds": 25.0} for n in (1, 2)]
    assert [r["predicted_seconds"] for r in budget.beside_measured(predicted, out, 10.0)] == [25.0, 35.0]
    assert [r["measured_seconds"] for r in budget.beside_measured(predicted, out, 10.0)] == [25.0, 35.0]


def test_a_federation_that_cannot_end_sooner_goes_on_and_says_it_runs_over():
    # one round asked: fewer is not possible, so the federation goes on and the trade says it runs over
    found = budget.replan(planned(rounds=1), "fedavg_dirichlet", measured((200.0, 5.0)),
                          opening_s=20.0, start_evaluation_s=5.0, launched_s=30.0, now_s=250.0)
    assert found["rounds"] == 1 and not found["cut"] and not found["fits"]
    assert "the 1 round runs over the 10 min budget (it cannot end before round 1)" in found["trade"]
    # nor does a replan after round 2 end a federation before round 3, the one its server waits to start
    over = budget.replan(planned(), "fedavg_dirichlet", measured((200.0, 5.0), (200.0, 5.0)),
                         opening_s=20.0, start_evaluation_s=5.0, launched_s=30.0, now_s=450.0)
    assert over["rounds"] == 3 and over["cut"] and not over["fits"] and over["trade"].endswith("all the same")


def test_the_federations_after_the_first_fit_what_remains_at_the_slowest_pace_measured():
    """After the replan, the machine may slow: the federations still to run fit what remains of the budget at the
    slowest pace a run of the stage has taken so far, and end sooner (never more rounds than those before ran)."""
    decision = {**planned(), "last_evaluation_extra_s": 10.0}  # 6 rounds of 25 s, the last 10 s more
    rounds_ = [{"round": n, "predicted_seconds": 25.0 + (10.0 if n == 6 else 0.0), "measured_seconds": m}
               for n, m in zip(range(1, 7), (25.0, 25.0, 25.0, 25.0, 25.0, 35.0))]
    # the first federation as predicted (160 s of rounds in 180 s: 5 s of round 0's evaluation, 15 s of start and
    # end), the reference at twice its prediction: 60 s of 6 x 10 s
    first = budget.federation_took("fedavg_dirichlet", rounds_, wall_s=180.0, start_evaluation_s=5.0)
    assert first["pace"] == 1.0 and first["beyond_seconds"] == 15.0
    reference = budget.reference_took(decision, 120.0)
    assert reference["pace"] == 2.0 and reference["predicted_seconds"] == 60.0
    left = ["ffa_dirichlet", "fedavg_iid"]
    # at 1x, 300 s in: 2 x (15 + 150 + 10) = 350 s more, 650 s > 600; 5 rounds: 300 + 2 x 150 = 600 s, the budget
    calm = budget.later_rounds(decision, left, [first], elapsed_s=300.0, most=6)
    assert calm["rounds"] == 5 and calm["cut"] and calm["fits"] and calm["predicted_seconds"] == pytest.approx(600.0)
    assert calm["trade"].endswith("ffa_dirichlet, fedavg_iid run 5 of 6 rounds to end in 10 min (predicted 10.0 "
                                  "min; 6 would end at 10.8 min)")
    # at the reference's 2x: 300 + 2 x (15 + 2 x (25 n + 10)) fits n = 2 (570 s)
    slowed = budget.later_rounds(decision, left, [first, reference], elapsed_s=300.0, most=6)
    assert slowed["rounds"] == 2 and slowed["pace"] == 2.0 and slowed["predicted_seconds"] == pytest.approx(570.0)
    assert "the slowest run so far (centralized) at 2.00x its prediction, 15 s beyond its rounds" in slowed["trade"]
    # the last federation, with room: the rounds those before ran, never more
    roomy = budget.later_rounds(decision, ["fedavg_iid"], [first], elapsed_s=300.0, most=4)
    assert roomy["rounds"] == 4 and not roomy["cut"] and roomy["fits"]
    assert roomy["trade"].endswith("fedavg_iid runs the 4 rounds, predicted to end at 7.1 min")
    # no room at all: one round runs, and the trade says the stage runs over
    late = budget.later_rounds(decision, left, [first], elapsed_s=590.0, most=6)
    assert late["rounds"] == 1 and not late["fits"] and late["trade"].endswith("over the budget all the same")


def test_a_cold_round_1_chooses_the_rounds_and_round_2_predicts_them():
    """Round 1 at twice its prediction, round 2 as predicted: the rounds are chosen as if every round took round 1's
    pace (the budget holds should they), and predicted at round 2's, the nearer to the rounds to come."""
    found = budget.replan(planned(), "fedavg_dirichlet", measured((40.0, 7.5), (20.0, 5.0)),
                          opening_s=20.0, start_evaluation_s=7.5, launched_s=30.0, now_s=100.0)
    assert found["cut"] and found["rounds"] == 3  # as the 2x case above
    assert found["training_scale"] == 1.0 and found["evaluation_scale"] == 1.0  # round 2's pace
    assert [(p["training_scale"], p["evaluation_scale"]) for p in found["paces"]] == [(2.0, 1.5), (1.0, 1.0)]
    # the 112.5 s of starts and ends above, and 3 rounds of 85 s
    assert found["predicted_seconds"] == pytest.approx(367.5) and found["per_round_seconds"] == [85.0, 85.0, 85.0]
    assert "the rounds chosen at the slowest, 2.00x and 1.50x" in found["trade"]
    # round 2 the slower (the machine slowed): chosen and predicted at round 2's pace
    slowing = budget.replan(planned(), "fedavg_dirichlet", measured((20.0, 5.0), (40.0, 7.5)),
                            opening_s=20.0, start_evaluation_s=7.5, launched_s=30.0, now_s=100.0)
    assert slowing["rounds"] == 3 and slowing["predicted_seconds"] == pytest.approx(600.0)


def test_a_pace_that_falls_from_round_1_to_round_2_is_predicted_halfway_to_the_calibrations():
    """Rounds 1 and 2 at 1.4x and 1.3x the calibration's training (1.2x, 1.1x its evaluation): a cold start fading,
    predicted at 1.15x and 1.05x; the rounds are still chosen at the slowest (1.4x, 1.2x)."""
    decision = {**planned(), "minutes": 20.0}
    found = budget.replan(decision, "fedavg_dirichlet", measured((28.0, 6.0), (26.0, 5.5)),
                          opening_s=7.5, start_evaluation_s=5.0, launched_s=30.0, now_s=100.0)
    assert (found["training_scale"], found["evaluation_scale"]) == (1.15, 1.05)
    assert [(p["training_scale"], p["evaluation_scale"]) for p in found["paces"]] == [(1.4, 1.2), (1.3, 1.1)]
    # 30 s + the first start (7.5 s) + 2 starts and 3 ends of 2.5 s + 6 rounds of 3 x (23 + 5.25) + 11.5 = 96.25 s
    assert found["rounds"] == 6 and not found["cut"] and found["predicted_seconds"] == pytest.approx(627.5)
    assert "predicted at 1.15x and 1.05x, halfway" in found["trade"]
    # at the slowest pace the 6 rounds would not fit in 10 min: the federations end with fewer
    tight = budget.replan(planned(), "fedavg_dirichlet", measured((28.0, 6.0), (26.0, 5.5)),
                          opening_s=7.5, start_evaluation_s=5.0, launched_s=30.0, now_s=100.0)
    assert tight["cut"] and 2 < tight["rounds"] < 6


def test_the_watch_replans_once_round_2_is_on_disk_and_answers_the_server(tmp_path):
    import time

    def write_round(out, number, **values):
        (out / "rounds").mkdir(parents=True, exist_ok=True)
        (out / "rounds" / f"round_{number:03d}.json").write_text(json.dumps({"round": number, **values}))

    fresh = tmp_path / "fresh"
    watch = budget.FirstRounds(planned(), "fedavg_dirichlet", began=time.perf_counter() - 30.0)
    watch.start()
    watch(fresh)
    assert watch.found is None  # nothing on disk yet
    time.sleep(0.05)  # file times are coarser than time.time()
    write_round(fresh, 0, evaluation_seconds=7.5)
    watch(fresh)
    assert watch.found is None  # round 0 only
    write_round(fresh, 1, round_seconds=40.0, evaluation_seconds=7.5)
    watch(fresh)
    assert watch.found is None and not (fresh / "replan.json").exists()  # round 1 only: round 2 decides
    write_round(fresh, 2, round_seconds=40.0, evaluation_seconds=7.5)
    watch(fresh)
    assert watch.found["cut"] and watch.found["rounds"] == 3  # 2x slower: 3 rounds (the case above)
    assert watch.found["after_round"] == 2 and len(watch.found["paces"]) == 2
    # what the server waits for after round 2 (server_app.replanned reads it)
    assert json.loads((fresh / "replan.json").read_text()) == {"after_round": 2, "rounds": 3}
    decided = watch.found
    watch(fresh)
    assert watch.found is decided  # decided once

    short = tmp_path / "short"  # a federation of two rounds is replanned after round 1: round 2 would leave none
    watch = budget.FirstRounds(planned(rounds=2), "fedavg_dirichlet", began=time.perf_counter() - 30.0)
    watch.start()
    time.sleep(0.05)
    write_round(short, 0, evaluation_seconds=7.5)
    write_round(short, 1, round_seconds=20.0, evaluation_seconds=5.0)
    watch(short)
    assert watch.found["after_round"] == 1 and not watch.found["cut"]
    assert json.loads((short / "replan.json").read_text()) == {"after_round": 1, "rounds": 2}

    resumed = tmp_path / "resumed"
    write_round(resumed, 0)
    write_round(resumed, 1, round_seconds=40.0, evaluation_seconds=7.5)
    write_round(resumed, 2, round_seconds=40.0, evaluation_seconds=7.5)
    time.sleep(0.05)
    watch = budget.FirstRounds(planned(), "fedavg_dirichlet", began=time.perf_counter())
    watch.start()
    watch(resumed)
    assert "resumed" in watch.found["skipped"]
    # a server that resumed before the round it waits after still gets an answer: go on with its rounds
    assert json.loads((resumed / "replan.json").read_text()) == {"after_round": 2, "rounds": None}
    assert budget.with_replan(planned(), watch.found)["rounds"] == 6  # the decision stands, the skip recorded
