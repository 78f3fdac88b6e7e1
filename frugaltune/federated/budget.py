"""The federated stage on a time budget (`federated.budget_minutes`): measure a client-round on this machine, predict
every round of every federation the stage runs (and its centralized reference), and run as many rounds as fit.

Library code, used by the federated stage; never run. The measurement is the planner's own calibration
(planner.calibration.calibrate): one fresh process runs the clients' loop (training.loop.train_classifier with the
LoopConfig local.client_loop builds, as for train_locally: constant lr, the plan's micro-batch, the clients'
precision and int8 products) over a few of a client's own micro-batches, and fits
`step = overhead + per_token x padded tokens`. From it:

- a client-round is the sum of its planned steps (its own rows, batched as its loop will batch them);
- a round runs the clients the ServerApp samples for it (aggregation.sample_clients, by client id: the same clients
  every run) on `workers` side by side (the Simulation Engine's Ray workers), then the server evaluates the test
  split: the same calibration process times the model's forward passes (the server's plain model) over a few of
  the test split's evaluation batches, and the server's threads scale them;
- the centralized reference trains as many examples as the first federation's clients, one process on every core.

The calibration's process is not the federation's: the clients' steps in a Ray worker and the server's evaluation
have taken well over what the calibration timed, and Flower's start-up is not timed at all (docs/DECISIONS.md,
"The budget decided twice"). So the decision is made twice. `FirstRounds` watches the first federation: once its
round 2 is on disk (round 1 when it runs two or fewer), `replan` scales every predicted round by what rounds 1 and 2
took against their predictions (the clients' and the evaluation's apart; the centralized reference's training as
the clients'): it chooses the rounds at the slower pace (round 1 is the stage's coldest) and predicts them at round
2's. It prices each federation's start
(Flower's start-up, as measured; round 0's evaluation only once: the federations start from the same bytes and share
it) and its end (Flower's shutdown and the export, at the start-up's measured price). When fewer rounds fit, the
first federation ends with them: the server waits for the replan after the rounds measured (`replan-after`) and
re-lays its lr decay over the new number from the next round on (server_app.replanned), so no round is thrown away.
The report keeps the first decision as `initial`, and puts what each round took beside the final prediction.

A machine can slow after the replan (other work on the host; on record, later federations and the reference ran up
to 1.2x the first federation's pace). The stage trains the centralized reference right after the first federation,
and before each later federation `later_rounds` fits the federations still to run into what remains of the budget
at the slowest pace a run has taken so far (`took`: each run's measured against its predicted seconds): they end
sooner when it does not fit (report: `budget.later`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from frugaltune.planner.calibration import calibrate
from frugaltune.planner.worker import CalibrationStopped
from frugaltune.planner.memory import Constants, MethodKnobs, model_shape, planned_batches, planned_order
from frugaltune.federated import aggregation, local, rounds, rows
from frugaltune.federated.plans import Precision, machine_cores
from frugaltune.federated.settings import RunSettings
from frugaltune.io import write_json

# The batch the ServerApp evaluates with (the stage leaves RunSettings' default)
EVAL_BATCH = RunSettings.model_fields["eval_batch_size"].default


@dataclass(frozen=True)
class Machine:
    """Where the rounds run: `threads` per client (federated.threads), `workers` clients side by side, and the
    threads the server's evaluation and the centralized reference use (every physical core)."""
    threads: int
    workers: int
    server_threads: int


def measure_client_round(model_dir: Path, labels: list[str], pad_token_id: int, parts: Path, plan: dict, *,
                         lora: MethodKnobs, batch_size: int, lr: float, seed: int, precision: Precision,
                         threads: int, allocator: str, test_ids: list[list[int]]) -> tuple[Constants, dict]:
    """The planner's calibration of the clients' loop on this machine, over client `plan`'s own rows and steps, with
    their precision and int8 products, and of the server's evaluation over a few of the test split's batches
    (`test_ids`)."""
    input_ids, targets = local.read_examples(rows.client_file(parts, plan["client"]))
    rank = plan["lora_rank"]
    knobs = replace(lora, r=rank, alpha=aggregation.client_alpha(lora.alpha, lora.r, rank))
    shape = model_shape(str(model_dir), len(labels), "lora", knobs)
    steps, order = planned_order([len(r) for r in input_ids], batch_size, 1, 1.0, plan["local_steps"], seed)
    loop = local.client_loop(steps=steps, lr=lr, batch_size=batch_size, micro_batch_size=plan["micro_batch_size"],
                             seed=seed, bf16=precision.bf16, eager_attention_max_len=precision.eager)
    return calibrate(model_dir, labels, pad_token_id, "lora", knobs, shape, rows=input_ids, targets=targets,
                     order=order, loop=loop,
                     int8={"on": precision.int8, "why": "the plan's int8 decision for the clients' LoRA"},
                     gradient_checkpointing=False, threads=threads, seed=seed, time_samples=4,
                     allocator=allocator, inference_rows=test_ids, inference_batch=EVAL_BATCH)


def step_seconds(constants: Constants, batches: list[tuple[int, int]]) -> float:
    """Seconds of these micro-batches ((rows, longest) each) at the calibrated speed."""
    return sum(constants.step_overhead_s + constants.seconds_per_token * n * longest for n, longest in batches)


def client_round_seconds(constants: Constants, parts: Path, plan: dict, batch_size: int, seed: int,
                         number: int) -> float:
    """One client's training in round `number`: its planned steps over its own rows (the seed its round trains with)."""
    lengths = list(rows.client_lengths(parts, plan["client"]))
    _, batches = planned_batches(lengths, batch_size, 1, 1.0, plan["local_steps"], seed * 1000 + number)
    return step_seconds(constants, batches)


def makespan(seconds: list[float], workers: int) -> float:
    """Clients run longest first on the first free worker: when the last one ends."""
    ends = [0.0] * max(1, workers)
    for value in sorted(seconds, reverse=True):
        ends[ends.index(min(ends))] += value
    return max(ends)


def evaluation_seconds(inference: dict, test_ids: list[list[int]], machine: Machine) -> float:
    """The server's evaluation of the test split (local.evaluate's batches), from the calibration's timed forward
    passes (`inference`: on the clients' threads) scaled to the server's threads."""
    lengths = [len(ids) for ids in test_ids]
    from frugaltune.classify import sorted_batches

    batches = [(len(b), max(lengths[i] for i in b)) for b in sorted_batches(lengths, EVAL_BATCH)]
    timed = Constants(step_overhead_s=inference["overhead_s"], seconds_per_token=inference["seconds_per_token"])
    return step_seconds(timed, batches) * inference["threads"] / machine.server_threads


def predict_rounds(constants: Constants, parts: Path, plans: list[dict], *, asked: int, fraction: float,
                   min_completed: int, batch_size: int, seed: int, machine: Machine, evaluation: float) -> list[dict]:
    """Rounds 1..asked of one federation: the clients the ServerApp samples in each, their seconds, the round's."""
    included = sorted((p for p in plans if p["fits"]), key=lambda p: p["client"])
    ids = {p["client"]: p["client"] for p in included}
    wanted = max(min_completed, math.ceil(fraction * len(included)))
    by_client = {p["client"]: p for p in included}
    predicted = []
    for number in range(1, asked + 1):
        sampled = aggregation.sample_clients(list(ids), ids, wanted, seed, number)
        clients = [client_round_seconds(constants, parts, by_client[c], batch_size, seed, number) for c in sampled]
        training = makespan(clients, machine.workers)
        predicted.append({"round": number, "clients": sorted(sampled), "training_seconds": round(training, 2),
                          "seconds": round(training + evaluation, 2),
                          "steps": sum(by_client[c]["local_steps"] for c in sampled)})
    return predicted


def centralized_seconds(constants: Constants, examples: int, mean_length: float, batch: int,
                        machine: Machine) -> float:
    """The centralized reference's training: `examples` rows of the mean padded length, on every core."""
    steps = max(1, round(examples / batch))
    own = steps * constants.step_overhead_s + constants.seconds_per_token * examples * mean_length
    return own * machine.threads / machine.server_threads


def choose_rounds(asked: int, budget_s: float, spent_s: float, fixed_s: float, per_round_s: list[float]) -> dict:
    """The most rounds (1..asked) whose predicted time, with what is spent and the fixed costs, fits `budget_s`.
    `per_round_s[n - 1]`: what round n adds to the stage (every federation's round n, and the reference's share)."""
    total, rounds = spent_s + fixed_s, 0
    for seconds in per_round_s[:asked]:
        if rounds and total + seconds > budget_s:
            break
        total, rounds = total + seconds, rounds + 1
    fits = total <= budget_s
    minutes = budget_s / 60
    if rounds == asked and fits:
        trade = f"{asked} rounds asked, all fit in {minutes:g} min (predicted {total / 60:.1f} min)"
    elif fits:
        trade = (f"{asked} rounds asked, {rounds} fit in {minutes:g} min (predicted {total / 60:.1f} min; "
                 f"{asked} would take {(spent_s + fixed_s + sum(per_round_s[:asked])) / 60:.1f} min)")
    else:
        trade = (f"{asked} rounds asked, not even 1 fits in {minutes:g} min: 1 round runs, predicted "
                 f"{total / 60:.1f} min (raise federated.budget_minutes or lower local_steps / num_clients)")
    return {"rounds_asked": asked, "rounds": rounds, "predicted_seconds": round(total, 1), "fits": fits,
            "trade": trade}


def decide(params, plans: dict[str, list[dict]], runs: list[tuple[str, str]], labels: list[str], pad_token_id: int,
           precision: Precision, spent_s: float, data: Path, model_dir: Path, cores: int | None = None) -> dict:
    """How many rounds the stage runs: `federated.num_rounds`, or as many as `federated.budget_minutes` fits (the
    stage's time so far counted in), predicted from a client-round measured here. `plans`: scheme -> the clients'
    plans; `runs`: (scheme, method) of each federation, in the order the stage runs them. `cores`: the machine's,
    as the plan counted them (None: read from reports/plan.json)."""
    fp, tp = params.federated, params.train
    asked = fp.num_rounds
    if fp.budget_minutes is None:
        return {"minutes": None, "rounds_asked": asked, "rounds": asked, "trade": f"no budget: {asked} rounds"}
    physical = cores or machine_cores()
    machine = Machine(threads=fp.threads, workers=max(1, physical // fp.threads), server_threads=physical)
    included = sorted((p for p in plans[runs[0][0]] if p["fits"]), key=lambda p: (p["examples"], p["client"]))
    probe = included[len(included) // 2]  # a client of the median size stands for the others' speed per token
    lora = fp.lora.knobs()
    test_ids, test_labels = local.read_examples(data / "test.parquet")
    try:
        constants, calibration = measure_client_round(
            model_dir, labels, pad_token_id, data / f"partitions_{runs[0][0]}", probe, lora=lora,
            batch_size=fp.batch_size, lr=fp.lr, seed=params.common.seed, precision=precision, threads=fp.threads,
            allocator=tp.allocator, test_ids=test_ids)
    except CalibrationStopped as exc:  # no speed to predict from: every round asked runs, and we say why
        return {"minutes": None, "rounds_asked": asked, "rounds": asked,
                "trade": f"{asked} rounds asked, all run: the budget of {fp.budget_minutes:g} min is not applied, "
                         f"{exc} (rerun the stage on a quieter machine for a budget)"}
    evaluation = evaluation_seconds(calibration["inference"], test_ids, machine)  # the whole split
    # rounds before the last evaluate a sample of it (server_app.evaluation_split); each federation's last the whole
    sample = local.sample_rows(test_labels, fp.round_eval_rows or 0, params.common.seed)
    between = evaluation_seconds(calibration["inference"], [test_ids[i] for i in sample], machine)
    last_extra = evaluation - between
    predicted = {f"{method}_{scheme}": predict_rounds(
        constants, data / f"partitions_{scheme}", plans[scheme], asked=asked, fraction=fp.fraction,
        min_completed=fp.min_completed, batch_size=fp.batch_size, seed=params.common.seed, machine=machine,
        evaluation=between) for scheme, method in runs}
    reference = [0.0] * asked
    if fp.centralized_baseline:  # it trains as many examples as the first federation's clients: a share per round
        lengths = [len(ids) for ids in local.read_examples(data / "train.parquet")[0]]
        mean_length = sum(lengths) / max(1, len(lengths))
        reference = [centralized_seconds(constants, r["steps"] * fp.batch_size, mean_length,
                                         tp.batch_size * tp.grad_accum, machine)
                     for r in next(iter(predicted.values()))]
    per_round = [sum(rounds_[n]["seconds"] for rounds_ in predicted.values()) + reference[n] for n in range(asked)]
    spent = spent_s + calibration["seconds"]
    # round 0 is evaluated once: the federations start from the same bytes (server_app.start_evaluation); each
    # federation's last round evaluates the whole split
    decision = choose_rounds(asked, fp.budget_minutes * 60, spent, evaluation + len(runs) * last_extra, per_round)
    return {"minutes": fp.budget_minutes, **decision, "spent_before_rounds_s": round(spent, 1),
            "evaluation_seconds": round(between, 2), "evaluation_rows": len(sample),
            "last_evaluation_extra_s": round(last_extra, 2), "per_round_seconds": [round(s, 2) for s in per_round],
            "reference_seconds": [round(s, 2) for s in reference[:max(1, decision["rounds"])]],
            "runs": {name: found[:max(1, decision["rounds"])] for name, found in predicted.items()},
            "calibration": {"client": probe["client"], "source": constants.source, "seconds": calibration["seconds"],
                            "step_overhead_s": constants.step_overhead_s,
                            "seconds_per_token": constants.seconds_per_token,
                            "evaluation": calibration["inference"],
                            "machine_busy": calibration["machine_busy"], "busy_note": calibration["busy_note"]},
            "machine": asdict(machine)}


def predicting_pace(paces: list[tuple[float, float]]) -> tuple[float, float]:
    """The (training, evaluation) pace the rounds to come are predicted at, from the measured rounds' paces against
    the calibration (1.0), in round order. A pace that fell from round 1 to round 2 is a cold start fading (each
    worker's first touch of each shape's kernels), and it went on fading in each of the three stages on record that
    measured both: predicted halfway between round 2's pace and the calibration's. A pace that held or rose is the
    machine's: predicted as measured. (docs/DECISIONS.md "The replan predicts halfway when the first rounds speed
    up", which names the replay of the stages on record.)"""
    fading = lambda i: len(paces) > 1 and paces[-1][i] < paces[0][i]  # noqa: E731
    return tuple((1.0 + paces[-1][i]) / 2 if fading(i) else paces[-1][i] for i in (0, 1))


def replan(decision: dict, first: str, measured: list[dict], opening_s: float, start_evaluation_s: float,
           launched_s: float, now_s: float) -> dict:
    """The rounds that fit, once the first federation (`first`, launched `launched_s` into the stage, now `now_s`) has
    run its first rounds (`measured`: their JSONs, the clients' `round_seconds` and the server's `evaluation_seconds`;
    round 1, and round 2 when it runs two or more) and took `opening_s` to start and evaluate round 0, of which
    `start_evaluation_s` evaluating (`decided_at_s` in the answer: `now_s`). Each measured round gives a pace: what it
    took against its prediction, the clients' training and the evaluation apart. Round 1 is the stage's coldest (the
    first touches of the clients' models and of each shape's kernels: docs/DECISIONS.md), so the rounds are chosen at
    the slowest pace measured, which keeps the stage within its budget should every round run as slowly, and predicted
    at the last round's, the nearest to the rounds to come, or halfway from it to the calibration's where round 2 ran
    faster than round 1 (a cold start that goes on fading): `training_scale`/`evaluation_scale`. Every federation's
    rounds are scaled by a pace, and the centralized reference's share as the clients' training (the same loop on the
    same machine). The other federations start from the same bytes and read round 0's evaluation
    (server_app.start_evaluation): each start costs the start-up, `opening_s` less that evaluation; each end (Flower's
    shutdown, the export) is priced as the start-up: the same processes stop as started. `cut`: the first federation
    (and every later one) ends with `rounds`, fewer than asked, never fewer than the round after the measured ones (the
    server waits for this answer before it)."""
    asked, predicted = decision["rounds"], decision["runs"][first]
    base_extra = decision.get("last_evaluation_extra_s", 0.0)

    def pace(found: dict) -> tuple[float, float]:
        planned = predicted[found["round"] - 1]
        # a round evaluated the sample, or the whole split when it is the last
        expected = decision["evaluation_seconds"] + (base_extra if found["round"] == asked else 0.0)
        return (found["round_seconds"] / max(planned["training_seconds"], 1e-9),
                found["evaluation_seconds"] / expected if expected else 1.0)

    paces = [pace(found) for found in measured]
    latest, slowest = paces[-1], (max(p[0] for p in paces), max(p[1] for p in paces))
    ahead = predicting_pace(paces)
    closing = start_up = max(0.0, opening_s - start_evaluation_s)
    budget_s, federations = decision["minutes"] * 60, len(decision["runs"])

    def priced(training: float, evaluation: float) -> dict:
        extra = base_extra * evaluation  # each federation's last round: the whole split, at the evaluation's pace
        runs = {name: [{**r, "training_seconds": round(r["training_seconds"] * training, 2),
                        "seconds": round(r["training_seconds"] * training
                                         + (r["seconds"] - r["training_seconds"]) * evaluation, 2)} for r in found]
                for name, found in decision["runs"].items()}
        # each round: the federations' scaled rounds, plus the reference's share scaled as training
        per_round = [sum(found[n]["seconds"] for found in runs.values())
                     + training * decision["reference_seconds"][n] for n in range(asked)]
        # the stage with n rounds: this start, the others' and every end, and each federation's rounds 1..n (the
        # first's rounds beyond n are not run: the server ends it there)
        def going_on(n: int) -> float:
            return (launched_s + opening_s + (federations - 1) * start_up + federations * (closing + extra)
                    + sum(per_round[:n]))
        return {"extra": extra, "runs": runs, "per_round": per_round, "going_on": going_on}

    chosen, expected = priced(*slowest), priced(*ahead)
    # the rounds it ends with: the most that fit at the slowest pace, never fewer than the next round (the server
    # waits for this answer after the rounds measured, and the last round evaluates the whole split)
    least = min(asked, measured[-1]["round"] + 1)
    rounds_ = next((n for n in range(asked, least, -1) if chosen["going_on"](n) <= budget_s), least)
    cut = rounds_ < asked
    predicted_s = round(expected["going_on"](rounds_), 1)
    fits = predicted_s <= budget_s
    numbers = " and ".join(str(found["round"]) for found in measured)
    measured_as = (f"after {first}'s round{'s' if len(measured) > 1 else ''} {numbers} ({latest[0]:.2f}x the "
                   f"calibration's training, {latest[1]:.2f}x its evaluation"
                   + (f"; the rounds chosen at the slowest, {slowest[0]:.2f}x and {slowest[1]:.2f}x"
                      if slowest != latest else "")
                   + (f"; predicted at {ahead[0]:.2f}x and {ahead[1]:.2f}x, halfway to the calibration's pace "
                      "where round 2 ran faster than round 1" if ahead != latest else "")
                   + f"; {opening_s:.0f} s to start and evaluate round 0, {start_up:.0f} s priced for each other "
                   "start and each end)")
    minutes, predicted_min = budget_s / 60, predicted_s / 60
    if cut:
        trade = (f"{measured_as}: {rounds_} of {asked} rounds fit in {minutes:g} min (predicted {predicted_min:.1f} "
                 f"min); {first} ends with round {rounds_}, the rounds after {measured[-1]['round']} at the lr of a "
                 f"{rounds_}-round federation" + ("" if fits else ", over the budget all the same"))
    else:
        them, one = (f"the {asked} rounds", "") if asked != 1 else ("the 1 round", "s")
        trade = (f"{measured_as}: {them} " + (f"fit{one} in {minutes:g} min" if fits else
                 f"run{one} over the {minutes:g} min budget (it cannot end before round {least})")
                 + f", predicted {predicted_min:.1f} min")
    return {"after_round": measured[-1]["round"], "run": first, "decided_at_s": round(now_s, 1),
            "training_scale": round(ahead[0], 3), "evaluation_scale": round(ahead[1], 3),
            "paces": [{"round": found["round"], "training_scale": round(t, 3), "evaluation_scale": round(e, 3)}
                      for found, (t, e) in zip(measured, paces)],
            "opening_seconds": round(opening_s, 1), "last_evaluation_extra_s": round(expected["extra"], 2),
            "closing_seconds": round(closing, 1),
            "rounds": rounds_, "predicted_seconds": predicted_s, "fits": fits, "cut": cut, "trade": trade,
            "per_round_seconds": [round(s, 2) for s in expected["per_round"][:rounds_]],
            "runs": {name: found[:rounds_] for name, found in expected["runs"].items()}}


class FirstRounds:
    """federation.federate's watch over the stage's first federation (`first` of `decision`; `began`: the stage's
    time.perf_counter() at its start): `start()` at each launch, then called with the federation's folder while it
    runs. Once its round `last` is on disk (2; 1 when it runs one or two) it replans from rounds 1..last (`replan`;
    `self.found`) and writes the answer the server waits for before round last + 1 (rounds.replan_path): the rounds
    it ends with. A federation that resumed rounds from an earlier invocation is not replanned (its start is not
    this one's) and goes on with its rounds."""

    def __init__(self, decision: dict, first: str, began: float):
        self.decision, self.first, self.began = decision, first, began
        # round 2 when a round is left after it for a replan to leave out, else round 1
        self.last = 2 if decision["rounds"] > 2 else 1
        self.found: dict | None = None
        self.launched_s = self.launched_at = 0.0

    def start(self) -> None:
        self.launched_s, self.launched_at = time.perf_counter() - self.began, time.time()

    def __call__(self, out: Path) -> None:
        if self.found is not None or (rounds.last_completed_round(out) or 0) < self.last:
            return
        opening = rounds.round_path(out, 0, "json").stat().st_mtime - self.launched_at
        if opening <= 0:  # round 0 is older than this launch: resumed
            self.found = {"skipped": "the first federation resumed rounds of an earlier run: no replan"}
        else:
            measured = [json.loads(rounds.round_path(out, n, "json").read_text()) for n in range(1, self.last + 1)]
            start = json.loads(rounds.round_path(out, 0, "json").read_text())
            self.found = replan(self.decision, self.first, measured, opening, start["evaluation_seconds"],
                                self.launched_s, time.perf_counter() - self.began)
        if not rounds.replan_path(out).exists():  # a resumed federation keeps the answer it ran with
            write_json(rounds.replan_path(out), {"after_round": self.last, "rounds": self.found.get("rounds")})


def with_replan(decision: dict, found: dict | None) -> dict:
    """The stage's budget after `FirstRounds`: the final rounds, prediction and trade, the first decision kept as
    `initial`."""
    if not found or "rounds" not in found:
        return {**decision, **({"replan": found} if found else {})}
    initial = {key: decision[key] for key in ("rounds", "predicted_seconds", "fits", "trade", "per_round_seconds")}
    final = {key: found[key] for key in ("rounds", "predicted_seconds", "fits", "trade", "per_round_seconds", "runs",
                                         "last_evaluation_extra_s")}
    replanned = {key: value for key, value in found.items() if key not in final}
    return {**decision, **final, "initial": initial, "replan": replanned}


def took(name: str, predicted_s: float, measured_s: float, beyond_s: float) -> dict:
    """What one federation, or the centralized reference, took against its prediction (`later_rounds`' `done`):
    its rounds (or its training) predicted and measured, and `beyond_s`, what it took besides (start-up, shutdown,
    export; the reference: none counted)."""
    return {"run": name, "predicted_seconds": round(predicted_s, 1), "measured_seconds": round(measured_s, 1),
            "pace": round(measured_s / predicted_s, 3) if predicted_s > 0 else None,
            "beyond_seconds": round(max(0.0, beyond_s), 1)}


def federation_took(name: str, round_seconds: list[dict], wall_s: float, start_evaluation_s: float) -> dict:
    """`took` for a federation from its `round_seconds` (beside_measured) and its wall time: what it took beyond
    its rounds is its start, its end and its export (round 0's evaluation, `start_evaluation_s`, left out: only the
    first federation evaluates it, the others read it)."""
    timed = [r for r in round_seconds if r["predicted_seconds"] is not None]
    measured = sum(r["measured_seconds"] for r in timed)
    return took(name, sum(r["predicted_seconds"] for r in timed), measured,
                wall_s - sum(r["measured_seconds"] for r in round_seconds) - start_evaluation_s)


def reference_took(decision: dict, train_s: float) -> dict:
    """`took` for the centralized reference: its training against its share of the rounds the federations run, as
    the replan scaled the clients' training."""
    scale = decision.get("replan", {}).get("training_scale", 1.0)
    return took("centralized", sum(decision["reference_seconds"][:decision["rounds"]]) * scale, train_s, 0.0)


def later_rounds(decision: dict, left: list[str], done: list[dict], elapsed_s: float, most: int) -> dict:
    """The rounds of the federations still to run (`left`, the next first), launched `elapsed_s` into the stage: the
    most, up to `most` (the rounds the federations before them ran), that fit in what remains of the budget should
    every one of them run at the slowest pace the stage has measured so far (`done`: `took` of each federation run
    and of the reference) and take beyond its rounds what the slowest of those federations took (start, end,
    export). Never fewer than 1. The replan decides from the first federation's first rounds; a machine that slows
    after it (other work on the host, a hotter CPU) shows in what the runs since took, and only the federations still
    to run can give time back: they end sooner, the lr decay laid over the rounds they run (docs/DECISIONS.md, "The
    federations after the first fit what remains")."""
    slowest = max((d for d in done if d["pace"] is not None), key=lambda d: d["pace"], default=None)
    pace = slowest["pace"] if slowest else 1.0
    beyond = max((d["beyond_seconds"] for d in done if d["run"] != "centralized"), default=0.0)
    extra = decision.get("last_evaluation_extra_s", 0.0)
    budget_s = decision["minutes"] * 60

    def ending(n: int) -> float:  # the stage's end if every federation left runs n rounds
        return elapsed_s + sum(beyond + pace * (sum(r["seconds"] for r in decision["runs"][name][:n]) + extra)
                               for name in left)

    rounds_ = next((n for n in range(most, 1, -1) if ending(n) <= budget_s), 1)
    predicted_s = round(ending(rounds_), 1)
    fits, minutes = predicted_s <= budget_s, budget_s / 60
    them = ", ".join(left) + (" runs" if len(left) == 1 else " run")
    measured_as = (f"{elapsed_s / 60:.1f} min in, the slowest run so far ({slowest['run'] if slowest else 'none'}) "
                   f"at {pace:.2f}x its prediction, {beyond:.0f} s beyond its rounds")
    if rounds_ < most:
        trade = (f"{measured_as}: {them} {rounds_} of {most} rounds to end in "
                 f"{minutes:g} min (predicted {predicted_s / 60:.1f} min; {most} would end at "
                 f"{ending(most) / 60:.1f} min)" + ("" if fits else ", over the budget all the same"))
    else:
        trade = f"{measured_as}: {them} the {most} rounds" + (
            f", predicted to end at {predicted_s / 60:.1f} min" if fits else
            f", over the {minutes:g} min budget (predicted {predicted_s / 60:.1f} min)")
    return {"run": left[0], "launched_at_s": round(elapsed_s, 1), "pace": round(pace, 3),
            "beyond_seconds": round(beyond, 1), "rounds": rounds_, "cut": rounds_ < most,
            "predicted_seconds": predicted_s, "fits": fits, "trade": trade}


def beside_measured(predicted: list[dict], out: Path, last_extra_s: float = 0.0) -> list[dict]:
    """Each completed round of the run in `out`: its predicted seconds beside what it took (its clients' round and
    the server's evaluation); the last round predicted `last_extra_s` longer (the whole test split evaluated)."""
    last = max((p["round"] for p in predicted), default=0)
    by_round = {p["round"]: {**p, "seconds": round(p["seconds"] + last_extra_s, 2)} if p["round"] == last else p
                for p in predicted}
    return [{"round": r["round"], "predicted_seconds": by_round.get(r["round"], {}).get("seconds"),
             "measured_seconds": round(r.get("round_seconds", 0.0) + r.get("evaluation_seconds", 0.0), 2)}
            for r in rounds.reports(out) if r["round"] > 0]
