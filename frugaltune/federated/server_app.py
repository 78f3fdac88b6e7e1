"""The Flower ServerApp: rounds of sample -> train on the clients -> aggregate (FedAvg or FFA-LoRA) -> evaluate the
global adapter on the server's test split; every completed round kept on disk, so a killed federation resumes.

Run by a SuperLink (the Flower venv) when the app is submitted, never directly:
    .venv-flower/bin/flwr run frugaltune/federated/flower_app <connection> --stream \
        --run-config "out-dir='checkpoints/federated/run' model-dir='models/base' ..."
with PYTHONPATH at the project root (the `federated` stage and tests/e2e/test_federated_pipeline.py do this; README
"Federated fine-tuning" shows it by hand). The run config is read once, as settings.RunSettings (its keys are those
of frugaltune/federated/flower_app/pyproject.toml).

On disk, in `out-dir`: `config.json` (what the rounds were computed with) and the rounds as
frugaltune/federated/rounds.py lays them out (`rounds/round_NNN.safetensors` + `.json`, 000 = the seeded start;
the JSON written last: a round exists when its JSON does). Starting again with the same
config continues after the last round on disk; a different config is refused (delete `out-dir` to start over).

With `replan-after` N the server waits, after round N, for the stage's `replan.json` (frugaltune/federated/budget.py
FirstRounds writes it from what rounds 1..N took): the rounds the federation ends with. Fewer than it started with
re-lay the lr decay over them from round N + 1 on (those rounds get the lr they would have in a federation of that
many rounds), and the last of them evaluates the whole test split.

With `secure-aggregation` the round runs Flower's SecAgg+ (frugaltune/federated/secure.py): the server sees
only the weighted mean of the clients' updates.

A round needs `min-completed` replies: the clients that fail or do not answer within `round-timeout` seconds are
reported and left out of that round's average (the strategy's completion floor); below the floor the run stops
with the reason, and a rerun resumes at that round.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path

import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp
from safetensors.torch import load_file, save_file

from frugaltune.federated import aggregation, local, wire
from frugaltune.federated.client_app import from_record, record_bytes, to_record
from frugaltune.federated.rounds import last_completed_round, replan_path, replanned_rounds, round_path, velocity_path
from frugaltune.federated.settings import RunSettings

app = ServerApp()

# Settings a round's result depends on: a resume continues only a run with the same ones.
RESULT_KEYS = ("model-dir", "labels", "test-data", "method", "lora-r", "lora-alpha", "lora-dropout",
               "lora-target-modules", "local-steps", "lr", "server-lr", "batch-size", "seed", "fraction", "pad-token-id",
               "dp-epsilon", "dp-delta", "dp-clip", "proximal-mu", "transmit-dtype", "secure-aggregation",
               "precision", "logit-adjustment", "server-momentum", "lr-schedule", "client-state",
               "round-eval-rows")


# How long the server waits for the stage's replan after round `replan-after` before it goes on unchanged: the
# stage's watch looks every second, so this only runs out when the stage is gone
REPLAN_WAIT_S = 120.0


def replanned(out: Path, settings: RunSettings, wait_s: float = 0.0) -> RunSettings:
    """`settings` with the rounds the stage's replan (rounds.replan_path) ends the federation with; waits up to
    `wait_s` for the answer. A replan to fewer rounds re-lays the lr decay: RunSettings.round_lr of the rounds still
    to run reads the new num_rounds."""
    deadline = time.monotonic() + wait_s
    while not replan_path(out).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    if wait_s and not replan_path(out).exists():
        print(f"federated: no replan from the stage in {wait_s:.0f} s: going on with {settings.num_rounds} rounds",
              flush=True)
    rounds = replanned_rounds(out)
    if rounds is None or rounds >= settings.num_rounds:
        return settings
    print(f"federated: replanned to {rounds} of {settings.num_rounds} rounds", flush=True)
    return settings.model_copy(update={"num_rounds": rounds})


class CompletionFloorError(RuntimeError):
    """Fewer clients than the completion floor finished a round."""


def atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


# Result keys added after federations were first kept on disk, at the value that reproduces those federations
DEFAULTS = {"server-momentum": 0.0, "lr-schedule": "constant", "client-state": "fresh", "round-eval-rows": 0}


def identity(settings: RunSettings) -> dict:
    """The settings a run's rounds depend on, under their Flower keys (as config.json keeps them). A decaying lr
    depends on the number of rounds too."""
    config = settings.to_flower()
    found = {key: config[key] for key in RESULT_KEYS}
    if settings.lr_schedule != "constant":
        found["num-rounds"] = settings.num_rounds
    return found


def check_config(out: Path, settings: RunSettings) -> None:
    """Refuse to continue rounds computed with other settings. Keys older runs did not store take their defaults,
    so a federation started before them resumes."""
    identity_now = identity(settings)
    stored = out / "config.json"
    if stored.exists():
        previous = json.loads(stored.read_text())
        changed = sorted(k for k in identity_now if previous.get(k, DEFAULTS.get(k)) != identity_now[k])
        if changed:
            raise ValueError(f"{out}: its rounds were computed with other settings ({', '.join(changed)}); delete "
                             f"{out} to start a new federation, or restore those settings to resume it.")
    else:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(stored, lambda p: p.write_text(json.dumps(identity_now, indent=2, sort_keys=True)))


def wait_for_nodes(grid: Grid, count: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= count or time.monotonic() > deadline:
            if len(nodes) < count:
                raise CompletionFloorError(f"only {len(nodes)} SuperNodes connected within {timeout:.0f}s; "
                                           f"federated.min_clients is {count}. Start more SuperNodes.")
            return nodes
        time.sleep(1.0)


def sent_to(messages: list[Message]) -> dict[str, int]:
    """message id -> destination node of messages the Grid has sent (it sets each message's id)."""
    return {m.metadata.message_id: m.metadata.dst_node_id for m in messages if m.metadata.message_id}


def answering_node(reply: Message, sent: dict[str, int]) -> int:
    """The node a reply is about. An error the SuperLink writes for a node it lost (no heartbeat) comes from the
    SuperLink itself (src_node_id 1): it is matched to the message it answers (`sent`, from `sent_to`)."""
    if reply.metadata.src_node_id in sent.values():
        return reply.metadata.src_node_id
    return sent.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)


def identify(grid: Grid, nodes: list[int], client_ids: dict[int, int | None], timeout: float) -> None:
    """Ask the nodes not in `client_ids` which client they are (the ClientApp's `query.identify`) and record it;
    a node that does not say (an error, no reply, no id in its settings) is recorded as None."""
    unknown = [node for node in nodes if node not in client_ids]
    if not unknown:
        return
    messages = [Message(RecordDict({"config": ConfigRecord({"want": "client-id"})}), node, "query.identify",
                        group_id="identify") for node in unknown]
    replies = list(grid.send_and_receive(messages, timeout=timeout))
    sent = sent_to(messages)
    for reply in replies:
        if not reply.has_error() and "client-id" in reply.content["metrics"]:
            client_ids[answering_node(reply, sent)] = int(reply.content["metrics"]["client-id"])
    for node in unknown:
        client_ids.setdefault(node, None)


def client_config(settings: RunSettings, round_number: int) -> ConfigRecord:
    """What a client gets with round `round_number` (settings.RoundSettings): the round's lr among the rest."""
    return ConfigRecord(settings.for_round(round_number).to_flower())


def evaluate_global(model, tensors, test, settings: RunSettings) -> dict:
    local.load_tensors(model, tensors)
    return local.evaluate(model, test[0], test[1], list(settings.labels), settings.pad_token_id,
                          settings.eval_batch_size, bf16=settings.precision == "bf16")


def start_evaluation(model, tensors: dict[str, torch.Tensor], start: Path, test, settings: RunSettings) -> dict:
    """Round 0's report: the seeded start (`tensors`, kept as `start`) evaluated, and the seconds that took. Every
    federation of a stage starts from the same bytes (one base, seed and LoRA shape; FedAvg and FFA alike), so with
    `start-evaluations` the evaluation is kept there, named by those bytes and the evaluation's own settings, and a
    later federation with the same start reads it (0 seconds; `evaluation_reused` names the file)."""
    def evaluate() -> dict:
        began = time.perf_counter()
        evaluation = evaluate_global(model, tensors, test, settings)
        return {"round": 0, "evaluation": evaluation, "evaluation_seconds": round(time.perf_counter() - began, 3)}

    if not settings.start_evaluations:
        return evaluate()
    with start.open("rb") as handle:
        digest = hashlib.file_digest(handle, "sha256")
    config = settings.to_flower()
    digest.update(json.dumps({key: config[key] for key in ("model-dir", "test-data", "labels", "pad-token-id",
                                                           "eval-batch-size", "precision", "threads")},
                             sort_keys=True).encode())
    kept = Path(settings.start_evaluations) / f"round_000_{digest.hexdigest()[:16]}.json"
    if kept.exists():
        return {"round": 0, "evaluation": json.loads(kept.read_text())["evaluation"], "evaluation_seconds": 0.0,
                "evaluation_reused": str(kept)}
    report = evaluate()
    kept.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(kept, lambda p: p.write_text(json.dumps({"evaluation": report["evaluation"]}, indent=2)))
    return report


def run_secure_round(grid: Grid, context: Context, settings: RunSettings, number: int,
                     tensors: dict[str, torch.Tensor], sampled: list[int]) -> tuple[dict, dict]:
    """One round under SecAgg+ (frugaltune/federated/secure.py): the server gets the weighted mean of the padded
    updates and never one client's tensors, so FedAvg's product_error (which needs them) is not reported."""
    from frugaltune.federated import secure

    method, floor = settings.method, settings.min_completed
    if len(sampled) < 2:
        raise CompletionFloorError(f"round {number}: SecAgg+ needs at least 2 sampled clients, {len(sampled)} were: "
                                   "raise federated.fraction or connect more SuperNodes.")
    upload = [name for name in sorted(tensors) if not (method == "ffa" and aggregation.is_lora_a(name))]
    started = time.perf_counter()
    result = secure.secure_round(grid, context, sampled, number, tensors, dict(client_config(settings, number)),
                                 upload, settings.transmit_dtype, settings.round_timeout, settings.secure_max_weight)
    reported = {client["node"] for client in result["clients"]}
    failures = [{"node": node, "reason": "no masked update within the round (failed, late or dropped)"}
                for node in sampled if node not in reported]
    if result["mean"] is None or len(result["clients"]) < floor:
        raise CompletionFloorError(
            f"round {number}: SecAgg+ completed with {len(result['clients'])} of {len(sampled)} clients, below "
            f"federated.min_completed {floor} (or too few to unmask). The last completed round is kept: rerun to "
            "resume from it.")
    mean = aggregation.aggregate(tensors, [(result["mean"], result["examples"])], method)  # a mean of one
    return mean, {"round": number, "sampled": len(sampled), "completed": len(result["clients"]),
                 "failures": failures, "clients": result["clients"], "secure_aggregation": True,
                 "bytes_down_per_client": result["bytes_down"],
                 "round_seconds": round(time.perf_counter() - started, 3)}


def run_round(grid: Grid, settings: RunSettings, number: int, tensors: dict[str, torch.Tensor],
              context: Context | None = None, client_ids: dict[int, int | None] | None = None) -> tuple[dict, dict]:
    """One round: the clients' aggregated adapter (before the server's step, `server_step`) and the round's
    client report. `client_ids`: node -> client id, kept across rounds (asked of new nodes here)."""
    nodes = wait_for_nodes(grid, settings.min_clients, settings.node_timeout)
    client_ids = {} if client_ids is None else client_ids
    identify(grid, nodes, client_ids, settings.round_timeout)
    wanted = max(settings.min_completed, math.ceil(settings.fraction * len(nodes)))
    sampled = aggregation.sample_clients(nodes, client_ids, wanted, settings.seed, number)
    dtype = settings.transmit_dtype
    # bf16 on the wire: the server's global becomes what the clients receive, so FFA's shared A is exactly theirs
    tensors = wire.round_trip(tensors, dtype) if dtype != "fp32" else tensors
    if settings.secure_aggregation:
        return run_secure_round(grid, context, settings, number, tensors, sampled)
    down = to_record(tensors, dtype)
    messages = [Message(RecordDict({"arrays": down, "config": client_config(settings, number)}), node,
                        MessageType.TRAIN, group_id=str(number)) for node in sampled]
    started = time.perf_counter()
    replies = list(grid.send_and_receive(messages, timeout=settings.round_timeout))
    updates, clients, failures = [], [], []
    answered = set()
    sent = sent_to(messages)
    for reply in replies:
        node = answering_node(reply, sent)
        answered.add(node)
        if reply.has_error():
            failures.append({"node": node, "reason": f"error {reply.error.code}: {reply.error.reason}"})
            continue
        metrics = dict(reply.content["metrics"])
        updates.append((from_record(reply.content["arrays"]), int(metrics["num-examples"])))
        clients.append({"node": node, **metrics})
    failures += [{"node": node, "reason": f"no reply within {settings.round_timeout}s"}
                 for node in sampled if node not in answered]
    floor = settings.min_completed
    if len(updates) < floor:
        raise CompletionFloorError(
            f"round {number}: {len(updates)} of {len(sampled)} clients completed, below federated.min_completed "
            f"{floor} ({'; '.join(f['reason'] for f in failures)}). The last completed round is kept: rerun to "
            "resume from it.")
    mean = aggregation.aggregate(tensors, updates, settings.method)
    report = {"round": number, "sampled": len(sampled), "completed": len(updates), "failures": failures,
              "clients": clients, "bytes_down_per_client": record_bytes(down),
              "round_seconds": round(time.perf_counter() - started, 3)}
    if settings.method == "fedavg":  # how far the averaged factors are from the averaged products
        report["product_error"] = round(aggregation.product_error(mean, updates), 6)
    return mean, report


@app.main()
def main(grid: Grid, context: Context) -> None:
    settings = RunSettings.from_flower(context.run_config)
    out = Path(settings.out_dir)
    check_config(out, settings)
    torch.set_num_threads(settings.threads)
    model = local.build_model(settings.model_dir, list(settings.labels), settings.pad_token_id, settings.seed,
                              settings.lora(), bf16=settings.precision == "bf16")
    test = local.read_examples(settings.test_data)
    (out / "rounds").mkdir(parents=True, exist_ok=True)

    last = last_completed_round(out)
    if last is None:  # round 0: the seeded start, evaluated (the untrained baseline)
        # with bf16 on the wire the start is its bf16 value too: FFA's A then never changes from round 0 on
        tensors = wire.round_trip(local.trainable_tensors(model), settings.transmit_dtype)
        atomic_write(round_path(out, 0, "safetensors"), lambda p: save_file(tensors, str(p)))
        report = start_evaluation(model, tensors, round_path(out, 0, "safetensors"), test, settings)
        atomic_write(round_path(out, 0, "json"), lambda p: p.write_text(json.dumps(report, indent=2)))
        last = 0
    else:
        tensors = load_file(str(round_path(out, last, "safetensors")))
        print(f"federated: resuming after round {last} from {round_path(out, last, 'safetensors')}", flush=True)
    momentum = settings.server_momentum
    # FedAvgM's velocity is state of the server's optimizer: kept beside each round, so a resume steps as before
    velocity = None
    if momentum > 0 and velocity_path(out, last).exists():
        velocity = load_file(str(velocity_path(out, last)))
        print(f"federated: loaded FedAvgM velocity of round {last}", flush=True)
    client_ids: dict[int, int | None] = {}
    launched, settings = settings, replanned(out, settings)  # a resumed federation keeps its replan
    number = last + 1
    while number <= settings.num_rounds:
        mean, report = run_round(grid, settings, number, tensors, context, client_ids)
        report["lr"] = settings.round_lr(number)  # the clients' rate this round (a replan re-lays its decay)
        tensors, velocity = aggregation.server_momentum_step(tensors, mean, settings.server_lr, momentum, velocity)
        if momentum > 0:
            atomic_write(velocity_path(out, number),
                         lambda p: save_file({k: v.contiguous() for k, v in velocity.items()}, str(p)))
        evaluating = time.perf_counter()
        split = local.evaluation_split(test, number, settings.num_rounds, settings.round_eval_rows, settings.seed)
        report["evaluation"] = evaluate_global(model, tensors, split, settings)
        report["evaluation_rows"] = len(split[1])
        # beside round_seconds (the clients'): what the budget's prediction of a round is compared with
        report["evaluation_seconds"] = round(time.perf_counter() - evaluating, 3)
        atomic_write(round_path(out, number, "safetensors"), lambda p: save_file(tensors, str(p)))
        atomic_write(round_path(out, number, "json"), lambda p: p.write_text(json.dumps(report, indent=2)))
        evaluation = report["evaluation"]
        print(f"federated: round {number}: {report['completed']}/{report['sampled']} clients, test accuracy "
              f"{evaluation['accuracy']:.4f} macro-F1 {evaluation['macro_f1']:.4f} loss {evaluation['loss']:.4f} "
              f"({len(split[1])} of {len(test[1])} test rows)", flush=True)
        if number == settings.replan_after and number < settings.num_rounds:
            settings = replanned(out, settings, REPLAN_WAIT_S)
        number += 1
    digest = hashlib.sha256(json.dumps(identity(launched), sort_keys=True).encode()).hexdigest()
    atomic_write(out / "done.json", lambda p: p.write_text(json.dumps(
        {"rounds": settings.num_rounds, "config_sha256": digest}, indent=2)))
