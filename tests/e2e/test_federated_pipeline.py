"""A real Flower deployment on loopback: a SuperLink and 3 SuperNodes as separate processes on 127.0.0.1 train a
tiny random llama's LoRA adapters for 2 rounds through the `federated` stage; a SuperNode killed mid-round does not stop the round; a SuperLink
killed after a round resumes from it (that federation with DP, FedProx and bf16 on the wire); the same apps on
Flower's Simulation Engine (Ray workers that keep the model between rounds). Run with `make test` (or `pytest -m slow tests/e2e/test_federated_pipeline.py`);
needs the Flower venv (`make flower-env`, which `make test` runs). About 2 minutes on 2 CPU cores.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from frugaltune.allocator import resolve
from frugaltune.federated.launch import LocalFederation, flower_processes

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
FLOWER_BIN = ROOT / ".venv-flower" / "bin"
APP = ROOT / "frugaltune" / "federated" / "flower_app"
RANKS = (2, 4, 4)  # heterogeneous clients; the global rank is 4
NPY_HEADER = 128  # np.save's header for these small arrays: what an Array carries besides the raw values


def rows(n: int, seed: int) -> pa.Table:
    """Learnable toy task: token 1 + label appears somewhere in each sequence of random tokens."""
    rng = random.Random(seed)
    ids, labels = [], []
    for _ in range(n):
        label = rng.randrange(3)
        seq = [rng.randrange(5, 60) for _ in range(rng.randrange(4, 10))]
        seq[rng.randrange(len(seq))] = 1 + label
        ids.append(seq)
        labels.append(label)
    return pa.table({"input_ids": ids, "labels": labels})


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    if not (FLOWER_BIN / "flower-superlink").exists():
        pytest.fail(f"{FLOWER_BIN} has no Flower: run `make flower-env` (make test does)")
    root = tmp_path_factory.mktemp("federated")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 pad_token_id=0)).save_pretrained(root / "model")
    for client in range(3):
        pq.write_table(rows(40, client), root / f"client_{client}.parquet")
    pq.write_table(rows(60, 99), root / "test.parquet")
    return root


def federation(world: Path, name: str, **extra_env: str) -> LocalFederation:
    nodes = [{"data": str(world / f"client_{i}.parquet"), "lora-rank": rank} for i, rank in enumerate(RANKS)]
    return LocalFederation(FLOWER_BIN, world / name, nodes, ROOT, extra_env=extra_env)


def run_config(world: Path, out: Path, **overrides) -> dict:
    return {"out-dir": str(out), "model-dir": str(world / "model"), "test-data": str(world / "test.parquet"),
            "labels": json.dumps(["a", "b", "c"]), "pad-token-id": 0, "num-rounds": 2, "fraction": 1.0,
            "min-clients": 3, "min-completed": 3, "round-timeout": 120.0, "lora-r": 4, "lora-alpha": 8,
            "local-steps": 2, "batch-size": 8, "method": "fedavg", **overrides}


def round_report(out: Path, number: int) -> dict:
    return json.loads((out / "rounds" / f"round_{number:03d}.json").read_text())


def wait_for(predicate, timeout: float, what: str, fed: LocalFederation) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{fed.log('superlink')[-4000:]}")
        time.sleep(0.5)


def submit_async(fed: LocalFederation, app_dir: Path, run_config: dict) -> subprocess.Popen:
    """`flwr run APP local --stream` as `fed.submit` runs it, without waiting: the test kills processes meanwhile."""
    args = fed.run_args(run_config)
    return fed._spawn("flwr_run", args[:2] + [str(app_dir), "local", "--stream"] + args[2:])


def leftovers(root: Path) -> list[list[str]]:
    """Live processes started for a federation under `root` (their FLWR_HOME is there)."""
    return [process.cmdline()[:2] for process in flower_processes(root)]


def test_the_stage_runs_three_supernodes_for_two_rounds_sending_only_the_adapter(world: Path, monkeypatch,
                                                                                   smol_tokenizer):
    """`stages.federated.run` in a project dir: partitions, per-client plans, a SuperLink + 3 SuperNodes, reports,
    figures; then `stages.federated_register.run` registers the global adapter as the centralized one would be."""
    import datasets

    from frugaltune import models
    from frugaltune.config import parse_params
    from frugaltune.federated import centralized
    from frugaltune.federated.plans import machine_precision
    from frugaltune.planner.machine import decide_machine
    from frugaltune.resolve import machine_facts, model_dims
    from tests.tiny_model import build_tiny_model
    from stages import federated as stage

    project = world / "project"
    # a base with a real tokenizer: the registered model is served (and MLflow checks an input example) on text
    build_tiny_model(project / "models/base", smol_tokenizer)
    tables = {name: pq.read_table(world / f"{name}.parquet") for name in ("client_0", "client_1", "client_2", "test")}
    train = pa.concat_tables([tables["client_0"], tables["client_1"], tables["client_2"]])
    datasets.DatasetDict({"train": datasets.Dataset(train), "test": datasets.Dataset(tables["test"])}).save_to_disk(
        str(project / "data/tokenized"))
    (project / "data/splits").mkdir(parents=True)
    (project / "data/splits/labels.json").write_text(json.dumps({"labels": ["a", "b", "c"]}))
    monkeypatch.chdir(project)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project / 'mlflow.db'}")
    # the plan stage's calibration of this CPU, written as it would be: 10 s per step at 2 threads. With a 15 s round
    # budget the small CPU box (2 cores) has time for 1 step, the laptop (4 cores, ~5 s a step) for its 2; the GPU
    # server gets no estimate from a CPU's calibration and keeps its 2.
    (project / "reports").mkdir(exist_ok=True)
    (project / "reports/hardware.json").write_text(json.dumps({"cpu": {"model": "Test CPU"}}))
    # the machine decisions as the plan stage makes them (its entry point): the clients read them, decide nothing
    hardware, measured = machine_facts()
    decided = decide_machine(hardware, measured, "auto", "auto", ("lora",), model_dims())
    (project / "reports/plan.json").write_text(json.dumps({
        "device": {"kind": "cpu", "name": "Test CPU"}, "threads": 2, "run": {"precision": decided["precision"]},
        "machine": decided,
        "constants": {"step_overhead_s": 10.0, "seconds_per_token": 0.0, "source": "test calibration"}}))
    assert machine_precision(parse_params({})).bf16 == decided["bf16"]
    # global rank 8: the presets give the laptop and the GPU server rank 8, the small CPU box rank 4
    params = parse_params({"common": {"seed": 0}, "tokenize": {"max_length": 16}, "federated": {
        "num_clients": 3, "partition": "iid", "methods": ["fedavg"], "iid_control": False, "num_rounds": 2,
        "fraction": 1.0, "min_completed": 3, "round_timeout_s": 120, "local_steps": 2, "round_budget_s": 15,
        "batch_size": 8, "lora": {"r": 8, "alpha": 16}, "runtime": "deployment",
        "server_momentum": 0.5}})  # FedAvgM's server state on disk beside the rounds the stage exports from
    submitted = []

    def first_start_fails(self, app_dir, run_config, timeout):  # the stage's LocalFederation.submit, once broken
        submitted.append(run_config["out-dir"])
        if len(submitted) == 1:  # a ServerApp that dies before it trains round 1
            run_config = {**run_config, "round-timeout": "not a number"}  # a real failure: RunSettings refuses it
        return real_submit(self, app_dir, run_config, timeout)

    real_submit = LocalFederation.submit
    monkeypatch.setattr(LocalFederation, "submit", first_start_fails)
    report = stage.run(params)
    # a run that ended without training a round is started once more, and that one finished it
    assert len(submitted) == 2 and submitted[0] == submitted[1]

    run = report["runs"]["fedavg_iid"]
    assert run["rounds"] == 2 and run["failures"] == 0
    # federated.budget_minutes (40 by default): a client-round measured here; both rounds fit, and each round's
    # predicted seconds stand beside what it took
    assert report["budget"]["initial"]["trade"].startswith("2 rounds asked, all fit in 40 min")
    # then the first federation's round 1 (of its second start: the first did not reach round 0) rescaled the
    # prediction, and both rounds still fit: it went on
    replan = report["budget"]["replan"]
    assert report["budget"]["rounds"] == 2 and not replan["cut"] and replan["training_scale"] > 0
    assert report["budget"]["trade"].startswith("after fedavg_iid's round 1") and "the 2 rounds fit in 40 min" in \
        report["budget"]["trade"]
    assert [r["round"] for r in run["round_seconds"]] == [1, 2]
    assert all(r["predicted_seconds"] > 0 and r["measured_seconds"] > 0 for r in run["round_seconds"])
    # what this invocation took: the run (both of its starts) inside the stage's whole
    assert 0 < run["wall_seconds"] < report["wall_seconds"]
    assert set(run["final"]) == {"accuracy", "macro_f1", "loss"}
    assert [c["examples"] for c in report["partitions"]["iid"]] == [40, 40, 40]
    assert sorted(c["lora_rank"] for c in report["clients"]["iid"]) == [4, 8, 8]
    plans = {c["preset"]: c for c in report["clients"]["iid"]}
    assert {name: plan["local_steps"] for name, plan in plans.items()} == {
        "laptop": 2, "small_cpu_box": 1, "gpu_server": 2}, plans
    assert plans["small_cpu_box"]["predicted_seconds"] == pytest.approx(10.0)
    assert plans["laptop"]["predicted_seconds"] == pytest.approx(10.0)  # 2 steps at ~5 s on its 4 cores
    assert plans["gpu_server"]["predicted_seconds"] is None and "GPU" in plans["gpu_server"]["time_note"]
    # on this host every client trains with federated.threads (1 here): 20 s a step, twice the calibrated 10 s on 2
    assert params.federated.threads == 1
    assert [plans[name]["predicted_seconds_here"] for name in ("laptop", "small_cpu_box", "gpu_server")] == [
        pytest.approx(40.0), pytest.approx(20.0), pytest.approx(40.0)]
    assert all(plan["calibration"].endswith("test calibration") for plan in plans.values())
    assert json.loads((project / "reports/federated.json").read_text())["runs"]["fedavg_iid"] == run
    assert not leftovers(project), leftovers(project)  # the finished run's ServerApp and ClientApps are gone
    # the centralized reference: as many examples as the clients trained on (2 rounds x (2 + 1 + 2) steps x 8), in
    # the train stage's recipe (batch 16 at train.lr, head at train.head_lr), not the clients' batch of 8
    central = report["centralized"]
    assert (central["examples"], central["steps"], central["training_rows"]) == (80, 5, 120)
    assert (central["batch_size"], central["lr"], central["head_lr"]) == (16, params.train.lr, params.train.head_lr)
    assert run["macro_f1_gap_to_centralized"] == pytest.approx(central["final"]["macro_f1"] - run["final"]["macro_f1"],
                                                               abs=1e-4)
    # trained once per reference key: the same reference again is read back, not retrained
    pad_token_id = models.pad_token_id(project / "models/base", smol_tokenizer)  # as the stage
    again = centralized.reference(params, ["a", "b", "c"], pad_token_id, 80)
    assert again.get("reused_from") and again["final"] == central["final"], again
    rows = (project / "reports/plots/federated_rounds.csv").read_text().splitlines()
    assert rows[0].startswith("run,round,accuracy,macro_f1,loss,bytes_total") and len(rows) == 4  # rounds 0, 1, 2
    assert (project / "reports/plots/federated_labels.csv").read_text().count("\n") > 3
    # each client's measured time and memory beside its plan, and the PNGs
    clients = (project / "reports/plots/federated_clients.csv").read_text().splitlines()
    assert clients[0].startswith("run,client,preset,rounds,peak_rss_mb,predicted_peak_mb") and len(clients) == 4
    for figure in ("federated_rounds.png", "federated_clients.png"):
        assert (project / "reports/figures" / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the final global adapter is registered like the centralized one: a version with its test metrics, @champion
    from stages import federated_register
    assert (project / "models/federated/fedavg_iid/adapter_config.json").is_file()
    registered = federated_register.run(params)
    assert registered["federated_run"] == "fedavg_iid" and registered["version"] == 1 and registered["promoted"] == 1
    assert registered["metric_value"] == pytest.approx(run["final"]["macro_f1"])
    assert json.loads((project / "reports/federated_register.json").read_text()) == registered

    out = next((project / "checkpoints/federated").glob("*/done.json")).parent
    start, final = load_file(str(out / "rounds/round_000.safetensors")), load_file(str(out / "rounds/round_002.safetensors"))
    assert {k: v.shape for k, v in final.items()} == {k: v.shape for k, v in start.items()}  # global rank 8
    assert any(not torch.equal(start[k], final[k]) for k in start)
    head = [k for k in final if "score" in k]
    assert head and all(".lora_A." in k or ".lora_B." in k or k in head for k in final)

    global_bytes = sum(t.numel() * 4 + NPY_HEADER for t in start.values())
    for number in (1, 2):
        report_round = round_report(out, number)
        assert report_round["completed"] == 3 and report_round["failures"] == []
        assert report_round["product_error"] > 0  # FedAvg of A and B separately is not the average of products
        for client in report_round["clients"]:
            rank = client["lora-rank"]
            # up: exactly this client's trainable tensors (A cut to its rank, B, head), serialized
            up = sum((t[:rank] if ".lora_A." in k else t[:, :rank] if ".lora_B." in k else t).numel() * 4
                     + NPY_HEADER for k, t in start.items())
            assert client["bytes-up"] == up and client["bytes-down"] == global_bytes
            # the steps its plan gave it: the small CPU box (client 1) 1 under the round budget, the others 2
            assert client["num-examples"] == 40 and client["steps"] == (1 if client["client-id"] == 1 else 2)
            # every process of the federation runs on train.allocator (auto: mimalloc where it is installed)
            assert client["mimalloc"] == int(resolve("auto") == "mimalloc")
    # only the adapter + head travel: far less than even this toy model; SmolLM2-135M: far more
    assert run["adapter_bytes"] * 5 < run["full_model_bytes"]


def test_a_killed_supernode_does_not_stop_the_round_and_a_killed_server_resumes(world: Path):
    out = world / "ffa_out"
    # round-timeout: a killed SuperNode never answers, and the SuperLink notices it only after 2 missed heartbeats
    # (>= 20 s), so the round ends at the timeout; 60 s leaves the live clients room on a 2-core machine that
    # also runs another test file (make test runs the end-to-end files on two workers).
    # with client-side DP on: each update clipped to norm 0.5, noise for ε = 50 per round
    # min-clients 3: round 1 waits for all three SuperNodes (supernode_2 must be sampled, to be killed mid-round)
    # and bf16 on the wire, FedProx on: both only change what the clients compute and send; server momentum and a
    # decaying lr: the server's optimizer state must survive the kill, and FFA's A must stay put under momentum
    config = run_config(world, out, method="ffa", **{"min-completed": 2, "min-clients": 3, "round-timeout": 60.0,
                                                     "dp-epsilon": 50.0, "dp-clip": 0.5, "transmit-dtype": "bf16",
                                                     "proximal-mu": 0.1, "server-momentum": 0.5,
                                                     "lr-schedule": "linear"})
    # each local step sleeps 1 s: a window in which to kill a SuperNode during its training
    fed = federation(world, "ffa", FRUGALTUNE_TEST_STEP_DELAY_S="1")
    try:
        fed.start()
        submit_async(fed, APP, config)
        # its first ClientApp answers the server's query.identify; the second trains
        wait_for(lambda: fed.log("supernode_2").count("Start `flwr-clientapp`") >= 2, 300,
                 "supernode_2 to start training", fed)
        fed.kill("supernode_2")  # kill -9 mid-round, its ClientApp with it
        wait_for(lambda: (out / "rounds/round_001.json").exists(), 300, "round 1 to complete without it", fed)
        first = round_report(out, 1)
        assert first["completed"] == 2 and len(first["failures"]) == 1, first
        round_1 = (out / "rounds/round_001.safetensors").read_bytes()

        fed.kill("superlink")  # the server dies (with its ServerApp) before round 2 is kept
        fed.kill("flwr_run")
        assert not (out / "rounds/round_002.json").exists()
        fed.start_superlink()  # same ports: the SuperNodes reconnect (with back-off: up to ~20 s)
        # the resumed run waits longer: reconnecting and starting the ClientApps is slow on a busy machine, and
        # the timeout is not one of the settings a round's result depends on
        # and the two SuperNodes left are enough to start a round
        result = fed.submit(APP, {**config, "round-timeout": 150.0, "min-clients": 2}, timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    finally:
        fed.stop()
    # Nothing of the federation outlives it: not the killed SuperLink's ServerApp, not the finished run's (Flower
    # starts them in sessions of their own, outside the process groups that stop() signals)
    assert not fed.strays(), [process.cmdline()[:2] for process in fed.strays()]
    assert "resuming after round 1" in result.stdout, result.stdout[-3000:]
    assert (out / "rounds/round_001.safetensors").read_bytes() == round_1  # kept, not recomputed
    assert (out / "done.json").exists(), result.stdout[-4000:]
    assert json.loads((out / "done.json").read_text())["rounds"] == 2
    assert "loaded FedAvgM velocity of round 1" in result.stdout, result.stdout[-3000:]
    assert (out / "rounds/velocity_002.safetensors").exists()
    start, final = load_file(str(out / "rounds/round_000.safetensors")), load_file(str(out / "rounds/round_002.safetensors"))
    for name in start:  # FFA-LoRA: A never moves from the server's seeded initialisation; B and the head train
        if ".lora_A." in name:
            assert torch.equal(start[name], final[name]), name
    assert any(not torch.equal(start[k], final[k]) for k in start if ".lora_B." in k)
    for number in (1, 2):
        report = round_report(out, number)
        assert report["completed"] == 2 and "product_error" not in report
        assert all(c["bytes-up"] < c["bytes-down"] for c in report["clients"])  # B + head up, A + B + head down
        # bf16: 2 bytes a value each way (the .npy header aside), exactly
        down_bf16 = sum(t.numel() * 2 + NPY_HEADER for t in start.values())
        assert report["bytes_down_per_client"] == down_bf16
        for client in report["clients"]:
            rank = client["lora-rank"]
            up = sum((t[:, :rank] if ".lora_B." in k else t).numel() * 2 + NPY_HEADER
                     for k, t in start.items() if ".lora_A." not in k)
            assert client["bytes-down"] == down_bf16 and client["bytes-up"] == up
        for client in report["clients"]:  # DP on: the update was clipped and noised with the mechanism's σ
            assert client["dp-noise-std"] == pytest.approx(0.5 * math.sqrt(2 * math.log(1.25 / 1e-5)) / 50, rel=1e-4)
            assert client["dp-update-norm"] > 0


def test_the_simulation_engine_runs_the_same_apps_and_its_workers_build_the_model_once(world: Path):
    """federated.runtime simulation: a SuperLink in simulation mode, 3 virtual SuperNodes on 2 Ray workers (the
    same ServerApp and ClientApp); a worker reuses the model it built for a rank, and the rounds come out as the
    deployment's do (same shapes, same bytes). With client-state kept, each client continues in round 2 the
    AdamW moments it saved in its own state-dir after round 1, whichever worker runs it."""
    out = world / "simulation_out"
    nodes = [{"data": str(world / f"client_{i}.parquet"), "lora-rank": rank,
              "state-dir": str(world / "simulation_state" / f"client_{i}")} for i, rank in enumerate(RANKS)]
    fed = LocalFederation(FLOWER_BIN, world / "simulation", nodes, ROOT, runtime="simulation", workers=2)
    with fed:
        assert not any(name.startswith("supernode") for name in fed.processes)  # no SuperNode processes
        result = fed.submit(APP, run_config(world, out, **{"client-state": "kept"}), timeout=600)
    assert result.returncode == 0 and (out / "done.json").exists(), result.stdout[-4000:] + result.stderr[-3000:]
    assert not fed.strays(), [process.cmdline()[:2] for process in fed.strays()]
    start = load_file(str(out / "rounds/round_000.safetensors"))
    final = load_file(str(out / "rounds/round_002.safetensors"))
    assert {k: v.shape for k, v in final.items()} == {k: v.shape for k, v in start.items()}
    assert any(not torch.equal(start[k], final[k]) for k in start)
    clients = [client for number in (1, 2) for client in round_report(out, number)["clients"]]
    assert len(clients) == 6 and sorted(c["lora-rank"] for c in clients) == sorted(RANKS * 2)
    assert {c["num-examples"] for c in clients} == {40}
    # 2 workers, 2 ranks, 6 calls: at least 2 calls find their rank's model already built in their worker
    assert sum(c["model-reused"] for c in clients) >= 2, clients
    assert [c["client-state-resumed"] for c in clients] == [0, 0, 0, 1, 1, 1], clients  # round 1 fresh, 2 kept
    for i in range(len(RANKS)):  # only the newest state stays on the client's disk
        assert [p.name for p in (world / "simulation_state" / f"client_{i}").iterdir()] == ["client_state_002.pt"]


def test_the_budgets_replan_ends_a_running_federation_with_fewer_rounds_keeping_those_run(world: Path):
    """federation.Watching, as the stage's budget uses it (budget.FirstRounds): once round 1 is on disk the watch
    answers the server (replan.json: 3 rounds). The server, which waits for that answer after round 1
    (`replan-after`), ends the federation after round 3 instead of 50: round 1 at the 50-round decay's rate, rounds
    2 and 3 at a 3-round decay's, round 3 evaluating the whole test split; nothing is started over."""
    from frugaltune.federated.federation import Watching
    from frugaltune.federated.settings import RunSettings

    out = world / "replanned_out"
    launches, answered = [], []

    class Watch:  # federation.Watch, as budget.FirstRounds is one
        def start(self) -> None:
            launches.append(time.time())

        def __call__(self, folder: Path) -> None:
            if (folder / "rounds/round_001.json").exists() and not answered:
                # the server is waiting: round 2 has not started
                answered.append(not (folder / "rounds/round_002.json").exists())
                (folder / "replan.json").write_text(json.dumps({"after_round": 1, "rounds": 3}))

    fed = LocalFederation(FLOWER_BIN, world / "replanned", [{"data": str(world / f"client_{i}.parquet"),
                                                             "lora-rank": r} for i, r in enumerate(RANKS)], ROOT,
                          runtime="simulation", workers=1)
    with fed:
        watching = Watching(out, Watch())
        result = fed.submit(APP, run_config(world, out, **{"num-rounds": 50, "replan-after": 1, "round-eval-rows": 6,
                                                            "lr-schedule": "linear"}), timeout=600)
        watching.finish()
    assert result.returncode == 0 and len(launches) == 1 and answered == [True], result.stdout[-3000:]
    assert "replanned to 3 of 50 rounds" in result.stdout, result.stdout[-3000:]
    assert json.loads((out / "done.json").read_text())["rounds"] == 3
    assert sorted(p.name for p in (out / "rounds").glob("*.json")) == [f"round_00{n}.json" for n in range(4)]
    lr = RunSettings.model_fields["lr"].default
    assert [round_report(out, n)["lr"] for n in (1, 2, 3)] == pytest.approx(
        [lr * (1 - 0.5 / 50), lr * (1 - 1.5 / 3), lr * (1 - 2.5 / 3)])
    assert [round_report(out, n)["evaluation_rows"] for n in (1, 2, 3)] == [6, 6, 60]  # the last: the whole split
    assert not fed.strays(), [process.cmdline()[:2] for process in fed.strays()]


def test_partitions_are_deterministic_for_a_seed_and_skewed_by_dirichlet(world: Path, tmp_path: Path):
    """flwr-datasets' partitioners on our own rows (no download), through the module the stage runs."""
    import subprocess

    train = tmp_path / "train.parquet"
    pq.write_table(pa.concat_tables([rows(100, seed) for seed in range(3)]), train)

    def partition(out: str, *args: str) -> dict:
        cmd = [str(FLOWER_BIN / "python"), "-m", "frugaltune.federated.partition", "--train", str(train),
               "--out", str(tmp_path / out), "--num-clients", "4", *args]
        subprocess.run(cmd, cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                       check=True, capture_output=True)
        return json.loads((tmp_path / out / "partitions.json").read_text())

    one = partition("a", "--scheme", "dirichlet", "--alpha", "0.3", "--seed", "7")
    two = partition("b", "--scheme", "dirichlet", "--alpha", "0.3", "--seed", "7")
    other = partition("c", "--scheme", "dirichlet", "--alpha", "0.3", "--seed", "8")
    iid = partition("d", "--scheme", "iid", "--seed", "7")
    assert one == two and one["clients"] != other["clients"]
    for client in range(4):
        assert (tmp_path / f"a/client_{client}.parquet").read_bytes() == (tmp_path / f"b/client_{client}.parquet").read_bytes()
    for summary in (one, iid):
        assert sum(c["examples"] for c in summary["clients"]) == 300
    assert [c["examples"] for c in iid["clients"]] == [75] * 4

    # Each client's file holds exactly its rows: together every training row once, histograms as summarised
    everyone = sorted((tuple(r["input_ids"]), r["labels"]) for r in pq.read_table(train).to_pylist())
    for out, summary in (("a", one), ("d", iid)):
        written = [pq.read_table(tmp_path / f"{out}/client_{c['client']}.parquet").to_pylist()
                   for c in summary["clients"]]
        assert [len(w) for w in written] == [c["examples"] for c in summary["clients"]]
        for part, c in zip(written, summary["clients"]):
            counts = {str(k): n for k, n in sorted(Counter(r["labels"] for r in part).items())}
            assert counts == c["label_histogram"]
        assert sorted((tuple(r["input_ids"]), r["labels"]) for w in written for r in w) == everyone

    def skew(summary: dict) -> float:  # the largest share one label takes of a client's rows, averaged
        return sum(max(c["label_histogram"].values()) / c["examples"] for c in summary["clients"]) / 4
    assert skew(one) > skew(iid) + 0.1


def test_client_dp_clips_the_update_to_its_norm_then_adds_noise(tmp_path: Path):
    """frugaltune/federated/privacy.py with Flower's DP primitives (in the Flower venv)."""
    import subprocess

    script = (
        "import torch, json\n"
        "from frugaltune.federated.privacy import privatize\n"
        "g = torch.Generator().manual_seed(0)\n"
        "received = {'b': torch.randn(8, 4, generator=g), 'head': torch.randn(3, 8, generator=g)}\n"
        "trained = {k: v + torch.randn(v.shape, generator=g) for k, v in received.items()}\n"
        "def norm(t): return float(sum(((t[k] - received[k]) ** 2).sum() for k in t) ** 0.5)\n"
        "almost, info = privatize(trained, received, 0.5, 1e9, 1e-5)\n"  # ε huge: noise ~0, clipping alone
        "noisy, _ = privatize(trained, received, 0.5, 1.0, 1e-5)\n"
        "print(json.dumps({'before': norm(trained), 'clipped': norm(almost), 'noisy': norm(noisy), **info}))\n")
    out = subprocess.run([str(FLOWER_BIN / "python"), "-c", script], cwd=ROOT, check=True, capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["before"] > 1 and result["dp-update-norm"] == pytest.approx(result["before"], rel=1e-5)
    assert result["clipped"] == pytest.approx(0.5, rel=1e-4)  # clipped to the norm, direction kept
    assert result["noisy"] > 2 * result["clipped"]  # σ = 0.5·sqrt(2 ln(1.25e5)) ≈ 2.4 per value at ε = 1


IDENTIFY_SCRIPT = """
import json, random
from flwr.app import Context, Message, RecordDict
from frugaltune.federated import aggregation, client_app, server_app


class Nodes:  # a Grid whose network is a function call: the real ClientApp answers the query
    def __init__(self, node_ids, node_configs):
        self.contexts = {n: Context(run_id=1, node_id=n, state=RecordDict(), run_config={}, node_config=c)
                         for n, c in zip(node_ids, node_configs)}

    def send_and_receive(self, messages, timeout=None):
        return [client_app.app(Message(m.content, dst_node_id=m.metadata.dst_node_id,
                                       message_type=m.metadata.message_type, group_id=m.metadata.group_id),
                               self.contexts[m.metadata.dst_node_id]) for m in messages]


configs = [{"client-id": c, "data": "unused.parquet"} for c in range(6)] + [{"partition-id": 6}, {}]
draws = []
for seed in (1, 2):  # two runs: Flower draws other node ids, in another order
    ids = random.Random(seed).sample(range(1, 2**62), len(configs))
    grid, known = Nodes(ids, configs), {}
    server_app.identify(grid, ids, known, 10.0)
    draws.append({"known": sorted(v for v in known.values() if v is not None),
                  "none": sum(v is None for v in known.values()),
                  "rounds": [sorted(known[n] for n in aggregation.sample_clients(ids, known, 3, 42, r)
                                    if known[n] is not None) for r in (1, 2, 3)]})
print(json.dumps(draws))
"""


def test_the_server_samples_the_same_clients_whatever_node_ids_flower_draws():
    """Flower draws node ids at random when a SuperNode starts; the ServerApp asks each node which client it is
    (the ClientApp's query.identify: its client-id, else its simulation partition-id) and samples by that, so two
    runs of a federation train the same clients in each round."""
    import subprocess

    out = subprocess.run([str(FLOWER_BIN / "python"), "-c", IDENTIFY_SCRIPT], cwd=ROOT, check=True,
                         capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    first, second = json.loads(out.stdout.strip().splitlines()[-1])
    assert first["known"] == list(range(7)) and first["none"] == 1  # partition-id 6 counts; no id: None
    assert first["rounds"] == second["rounds"]
    assert len({tuple(r) for r in first["rounds"]}) > 1  # the rounds themselves draw different clients


SECAGG_SCRIPT = """
import copy, json, sys, tomllib
from pathlib import Path
from flwr.app import Context, Message, RecordDict
from frugaltune.federated import client_app, local, server_app
from frugaltune.federated.settings import RunSettings
world, app_toml, method = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
RANKS = {11: 2, 12: 4, 13: 4}


class Loopback:  # Flower's Grid with a function call for the network; messages copied as serialization would
    run = type("Run", (), {"run_id": 1})()

    def __init__(self):
        self.contexts = {n: Context(run_id=1, node_id=n, state=RecordDict(), run_config={}, node_config={
            "data": str(world / f"client_{i}.parquet"), "lora-rank": r}) for i, (n, r) in enumerate(RANKS.items())}

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, timeout=None):
        return [client_app.app(Message(copy.deepcopy(m.content), dst_node_id=m.metadata.dst_node_id,
                                       message_type=m.metadata.message_type, group_id=m.metadata.group_id),
                               self.contexts[m.metadata.dst_node_id]) for m in messages]


config = {**tomllib.loads(app_toml.read_text())["tool"]["flwr"]["app"]["config"], "model-dir": str(world / "model"),
          "labels": json.dumps(["a", "b", "c"]), "pad-token-id": 0, "fraction": 1.0, "min-clients": 3,
          "min-completed": 3, "lora-r": 4, "lora-alpha": 8, "local-steps": 2, "method": method,
          "secure-max-weight": 40.0}
settings = RunSettings.from_flower(config)  # as the ServerApp reads its run config
start = local.trainable_tensors(local.build_model(settings.model_dir, ["a", "b", "c"], 0, settings.seed,
                                                  settings.lora()))
plain, _ = server_app.run_round(Loopback(), settings, 1, start)
server = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
secure, report = server_app.run_round(Loopback(), settings.model_copy(update={"secure_aggregation": True}), 1, start,
                                      server)
print(json.dumps({"max_diff": max(float((plain[k] - secure[k]).abs().max()) for k in start),
                  "moved": max(float((plain[k] - start[k]).abs().max()) for k in start),
                  "shapes": all(plain[k].shape == secure[k].shape for k in start),
                  "completed": report["completed"], "secure": report["secure_aggregation"],
                  "product_error": "product_error" in report,
                  "clients_secure": all(c["secure-aggregation"] == 1 for c in report["clients"])}))
"""


@pytest.mark.parametrize("method", ["fedavg", "ffa"])
def test_secagg_plus_gives_the_plain_mean_without_showing_the_server_an_update(world: Path, method: str):
    """Flower's SecAggPlusWorkflow and secaggplus_mod run our ServerApp round and ClientApp unchanged, with an
    in-process Grid for the network (the protocol's four exchanges, no SuperLink): the same clients, trained the same
    way, give the same global adapter as the plain round up to SecAgg+'s quantization, for FedAvg and FFA with mixed
    ranks, and the report carries no per-client product error (the server never holds one client's update)."""
    import subprocess

    out = subprocess.run([str(FLOWER_BIN / "python"), "-c", SECAGG_SCRIPT, str(world),
                          str(APP / "pyproject.toml"), method], cwd=ROOT, check=True, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                              "HF_HUB_OFFLINE": "1"})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["completed"] == 3 and result["secure"] and result["clients_secure"] and result["shapes"]
    assert not result["product_error"]
    # quantization: 2^22 levels over +-8 after weighting by 40/40 -> a few 1e-6; the update itself is far larger
    assert result["max_diff"] < 2e-5 and result["moved"] > 10 * result["max_diff"]


START_SCRIPT = """
import json, sys, tomllib
from pathlib import Path
from safetensors.torch import save_file
from frugaltune.federated import local, server_app
from frugaltune.federated.settings import RunSettings
world, app_toml, shared = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
config = {**tomllib.loads(app_toml.read_text())["tool"]["flwr"]["app"]["config"], "model-dir": str(world / "model"),
          "test-data": str(world / "test.parquet"), "labels": json.dumps(["a", "b", "c"]), "pad-token-id": 0,
          "lora-r": 4, "lora-alpha": 8, "start-evaluations": str(shared)}
settings = RunSettings.from_flower(config)
test = local.read_examples(settings.test_data)
found = []
for seed, method in ((0, "fedavg"), (0, "ffa"), (1, "fedavg")):  # FedAvg and FFA start alike; another seed does not
    run = settings.model_copy(update={"seed": seed, "method": method})
    model = local.build_model(run.model_dir, ["a", "b", "c"], 0, run.seed, run.lora())
    start, tensors = world / f"start_{seed}_{method}.safetensors", local.trainable_tensors(model)
    save_file(tensors, str(start))
    found.append(server_app.start_evaluation(model, tensors, start, test, run))
plain = server_app.start_evaluation(model, tensors, start, test,
                                    settings.model_copy(update={"seed": 1, "start_evaluations": ""}))
print(json.dumps({"found": found, "plain": plain, "kept": sorted(p.name for p in shared.iterdir())}))
"""


def test_federations_with_the_same_start_evaluate_round_0_once(world: Path):
    """The stage's federations start from the same bytes (one base, seed and LoRA shape; FedAvg and FFA alike): the
    first evaluates round 0 and keeps it in `start-evaluations`, the next reads it (0 seconds, the file named); a
    start of other bytes (another seed) is evaluated, and so is any start without the folder."""
    import subprocess

    shared = world / "start_evaluations"
    out = subprocess.run([str(FLOWER_BIN / "python"), "-c", START_SCRIPT, str(world), str(APP / "pyproject.toml"),
                          str(shared)], cwd=ROOT, check=True, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                              "HF_HUB_OFFLINE": "1"})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    first, same, other = result["found"]
    assert "evaluation_reused" not in first and first["evaluation_seconds"] > 0
    assert same["evaluation_reused"].startswith(str(shared)) and same["evaluation_seconds"] == 0.0
    assert same["evaluation"] == first["evaluation"]
    assert "evaluation_reused" not in other and other["evaluation"] != first["evaluation"]
    assert len(result["kept"]) == 2  # one file a start
    assert "evaluation_reused" not in result["plain"] and result["plain"]["evaluation"] == other["evaluation"]
