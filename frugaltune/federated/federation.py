"""One federation on this machine: partition the training split (flwr-datasets, in the Flower venv), turn the
params and the clients' plans into the run's settings (settings.RunSettings / NodeSettings), run it with
LocalFederation (frugaltune/federated/launch.py) and start it once more if it ended before training a round.

Library code, used by the federated stage (stages/federated.py); never run. It imports no Flower: it runs the
Flower venv's commands (`make flower-env`), with the project root on PYTHONPATH so that every Flower process runs
this checkout's frugaltune.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Protocol

from frugaltune import paths
from frugaltune.config import FederatedParams, Params
from frugaltune.federated import keys, rounds, rows
from frugaltune.federated.plans import Precision, machine_cores
from frugaltune.federated.keys import PROJECT_ROOT
from frugaltune.federated.launch import LocalFederation
from frugaltune.federated.settings import NodeSettings, RunSettings

FLOWER_BIN = PROJECT_ROOT / ".venv-flower" / "bin"
APP = PROJECT_ROOT / "frugaltune" / "federated" / "flower_app"


def require_flower() -> None:
    if not (FLOWER_BIN / "flower-superlink").exists():
        raise RuntimeError(f"{FLOWER_BIN}: no Flower. Run `make flower-env` first (make federated does).")


def partition(fp: FederatedParams, seed: int, scheme: str, out: Path) -> dict:
    """flwr-datasets' partitioners run in the Flower venv (frugaltune/federated/partition.py)."""
    cmd = [str(FLOWER_BIN / "python"), "-m", "frugaltune.federated.partition", "--train",
           str((paths.FEDERATED_DATA / "train.parquet").resolve()), "--out", str(out.resolve()), "--scheme", scheme,
           "--num-clients", str(fp.num_clients), "--alpha", str(fp.alpha), "--seed", str(seed)]
    cmd += ["--by", fp.partition_by] if fp.partition_by else []
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"partition failed ({proc.returncode}): {proc.stderr[-3000:]}")
    print(proc.stdout.strip())
    return json.loads((out / "partitions.json").read_text())


def included_clients(fp: FederatedParams, plans: list[dict]) -> list[dict]:
    """The clients whose plans fit their hardware; an error naming each left-out one if too few do."""
    included = [p for p in plans if p["fits"]]
    if len(included) < fp.min_completed:
        raise RuntimeError(f"federated: {len(included)} clients fit their hardware, fewer than federated."
                           f"min_completed {fp.min_completed}: " + "; ".join(
                               f"client {p['client']} ({p['preset']}): {p['reason']}" for p in plans if not p["fits"]))
    return included


def run_settings(params: Params, method: str, out: Path, included: list[dict], labels: list[str], pad_token_id: int,
                 precision: Precision, num_rounds: int | None = None, replan_after: int = 0) -> RunSettings:
    """The run config of one federation: `federated.*` under Flower's keys, with the paths, labels and pad id of
    this project, the clients the plans include, the rounds to run (default `federated.num_rounds`) and the round
    after which the server waits for the stage's replan (0: none)."""
    fp = params.federated
    bf16 = precision.bf16
    test = paths.FEDERATED_DATA / "test.parquet"
    return RunSettings(
        out_dir=str(out), model_dir=str(paths.BASE_MODEL.resolve()), test_data=str(test.resolve()), labels=labels,
        start_evaluations=str(keys.start_evaluations(test).resolve()),
        pad_token_id=pad_token_id, num_rounds=num_rounds or fp.num_rounds, fraction=fp.fraction,
        min_clients=min(len(included), max(fp.min_completed, 2)), min_completed=fp.min_completed,
        round_timeout=float(fp.round_timeout_s), method=method, lora_r=fp.lora.r, lora_alpha=fp.lora.alpha,
        lora_dropout=fp.lora.dropout, lora_target_modules=fp.lora.target_modules, local_steps=fp.local_steps,
        lr=fp.lr, head_lr=fp.head_lr or 0.0, server_lr=fp.server_lr, server_momentum=fp.server_momentum,
        lr_schedule=fp.lr_schedule, round_eval_rows=fp.round_eval_rows or 0, replan_after=replan_after,
        batch_size=fp.batch_size, seed=params.common.seed,
        # the server evaluates between rounds, while this host's clients wait: it may use every core
        threads=machine_cores(),
        dp_epsilon=fp.dp.epsilon if fp.dp.enabled else 0.0, dp_delta=fp.dp.delta, dp_clip=fp.dp.clipping_norm,
        proximal_mu=fp.proximal_mu, logit_adjustment=fp.logit_adjustment, client_state=fp.client_state,
        transmit_dtype=fp.transmit_dtype, secure_aggregation=fp.secure_aggregation,
        precision="bf16" if bf16 else "fp32",
        # SecAgg+ quantizes each update weighted by num_examples / this: the largest client's share
        secure_max_weight=float(max(p["examples"] for p in included)))


def node_settings(fp: FederatedParams, parts: Path, out: Path, included: list[dict],
                  precision: Precision) -> list[NodeSettings]:
    """Each included client's node settings: its rows, its plan and this machine's precision (every client of the
    stage trains here). Its own disk, simulated, is a folder of the run: where it keeps its optimizer's moments
    between rounds (client_state: kept)."""
    return [NodeSettings(data=str(rows.client_file(parts, p["client"]).resolve()), lora_rank=p["lora_rank"],
                         micro_batch=p["micro_batch_size"], local_steps=p["local_steps"], threads=fp.threads,
                         client_id=p["client"], precision="bf16" if precision.bf16 else "fp32",
                         eager_attention_max_len=precision.eager, int8_products=precision.int8,
                         state_dir=str(out / "clients" / f"client_{p['client']}"))
            for p in included]


def federate(params: Params, name: str, settings: RunSettings, nodes: list[NodeSettings], workdir: Path,
             watch: Watch | None = None) -> Path:
    """Run the federation `settings` describes over `nodes` until done.json says it finished; its rounds' folder.
    `watch` (budget.FirstRounds): `watch.start()` at each launch, then `watch(out)` every second while it runs (it
    writes the replan the server waits for after round `settings.replan_after`)."""
    fp = params.federated
    out = Path(settings.out_dir)
    config, node_configs = settings.to_flower(), [node.to_flower() for node in nodes]
    attempt = 1
    while True:
        before = rounds.last_completed_round(out)
        # every SuperNode starts anew with its SuperLink: a database kept from an earlier start would only add the
        # nodes of that start, which a round then samples and waits for in vain
        for stale in Path(workdir).glob("superlink.db*"):
            stale.unlink()
        # Simulation Engine: one Ray worker per `threads` physical cores, so clients train side by side without
        # oversubscribing. Every process on train.allocator, the malloc the plan's calibration ran on.
        with LocalFederation(FLOWER_BIN, workdir, node_configs, PROJECT_ROOT, threads=fp.threads, runtime=fp.runtime,
                             workers=max(1, machine_cores() // fp.threads),
                             allocator=params.train.allocator) as fed:
            watching = Watching(out, watch) if watch is not None else None
            result = fed.submit(APP, config, timeout=None)
            if watching:
                watching.finish()
        if (out / "done.json").exists():  # `flwr run` exits 0 even when the ServerApp raised
            return out
        failure = f"the ServerApp did not finish{serverapp_status(workdir)}:\n{result.stdout[-4000:]}"
        # A run that ended without completing a training round is started once more, from the last completed
        # round: Ray's node can time out during startup on a small machine (docs/DECISIONS.md), and the rounds on
        # disk make a second start cheap. A run that trained a round, or fails twice, stops the stage with the reason.
        if attempt > 1 or (rounds.last_completed_round(out) or 0) > (before or 0):
            raise RuntimeError(f"federated {name}: {failure}")
        print(f"federated {name}: ended before training a round; starting it once more from round "
              f"{before or 0}. First attempt: {failure[-1500:]}", flush=True)
        attempt += 1


class Watch(Protocol):
    """What `federate` calls while a federation runs (budget.FirstRounds is the stage's)."""

    def start(self) -> None:
        """At each launch of the federation."""

    def __call__(self, out: Path) -> None:
        """Every second while it runs, with its rounds' folder."""


class Watching:
    """`watch.start()` at this launch, then a thread that calls `watch(out)` every second while the federation
    runs; an error it raises is raised again by `finish()`, in the stage's thread."""

    def __init__(self, out: Path, watch: Watch):
        self.out, self.watch = out, watch
        watch.start()
        self.done, self.error = threading.Event(), None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.done.wait(1.0):
                self.watch(self.out)
        except Exception as error:
            self.error = error

    def finish(self) -> None:
        self.done.set()
        self.thread.join()
        if self.error is not None:
            raise self.error


def serverapp_status(workdir: Path) -> str:
    """Why the SuperLink ended the ServerApp, from its database (e.g. "No heartbeat received from the task": a
    ServerApp starved of CPU for 60 s is failed without a traceback in the stream); "" when it says nothing."""
    import sqlite3

    try:
        with sqlite3.connect(f"file:{workdir / 'superlink.db'}?mode=ro", uri=True) as db:
            found = db.execute("SELECT sub_status, details FROM task WHERE type = 'flwr-serverapp'").fetchall()
    except sqlite3.Error:
        return ""
    return "".join(f" (SuperLink: {status}: {details})" for status, details in found[-1:] if status or details)
