"""Start Flower on this machine and submit the app with `flwr run`, stop everything after. Two runtimes:

- deployment: one SuperLink and N SuperNodes as separate processes on 127.0.0.1 (random free ports, insecure:
  loopback only), the same deployment as across machines (README "Federated fine-tuning") with every process on one
  host. Flower 1.32 starts a fresh ClientApp process for every message, so each client-round imports torch and
  builds the model again.
- simulation: a SuperLink in simulation mode; `flwr run` makes its Simulation Engine run N virtual SuperNodes on
  Ray workers (`workers` processes, `flwr[simulation]`) that stay up for the whole run, so a
  worker builds the model once (frugaltune.federated.local.cached_model). Same ServerApp, same ClientApp.
  Each worker gets `threads` CPUs of Ray's `workers * threads`.

Every process it starts (SuperLink, SuperNodes and the ClientApps they start, `flwr run`, the ServerApp, Ray's
workers: they inherit the environment) runs on `allocator` (frugaltune.allocator: the train stage's
`train.allocator`, LD_PRELOAD set or removed), so a client trains on the malloc the planner calibrated.

Library code used by the `federated` stage and tests/e2e/test_federated_pipeline.py; it imports no Flower (it runs the
Flower venv's commands, `make flower-env`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from frugaltune import processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return "'" + str(value).replace("'", "") + "'"  # TOML literal string: no escapes


def config_string(values: dict) -> str:
    """`key=value key=value` as --run-config / --node-config read it."""
    return " ".join(f"{key}={toml_value(value)}" for key, value in values.items())


def descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def flower_processes(under: Path) -> list:
    """Live processes whose FLWR_HOME is `under` or inside it: every process of a LocalFederation there, and what
    Flower started from them in sessions of their own (they inherit the environment, not the process group)."""
    import psutil

    root, found = str(under), []
    for process in psutil.process_iter():
        try:
            home = process.environ().get("FLWR_HOME", "")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if home == root or home.startswith(root + os.sep):
            found.append(process)
    return found


@dataclass
class LocalFederation:
    """A SuperLink and SuperNodes on 127.0.0.1. `node_configs[i]` is SuperNode i's --node-config values."""
    flower_bin: Path  # the Flower venv's bin/ (flower-superlink, flower-supernode, flwr)
    workdir: Path  # FLWR_HOME and the processes' logs
    node_configs: list[dict]
    project_root: Path  # on PYTHONPATH: the apps are frugaltune's modules
    threads: int = 1
    extra_env: dict[str, str] = field(default_factory=dict)  # e.g. a test's FRUGALTUNE_TEST_STEP_DELAY_S
    # "simulation": no SuperNode processes; len(node_configs) virtual nodes on `workers` Ray workers, each node's
    # settings read by the ClientApp from the run config's `simulation-nodes` file (written by `submit`)
    runtime: str = "deployment"
    workers: int = 2
    # malloc of every process of the federation (frugaltune.allocator.CHOICES). "system" is what a process gets
    # without a preload; the stage passes train.allocator (auto = mimalloc where installed): measured on a client's
    # rounds, mimalloc took less time and memory (docs/DECISIONS.md, "Training runs on mimalloc")
    allocator: str = "system"
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # the processes run in project_root; a relative workdir (the stage's cwd) must not move with them
        self.workdir, self.flower_bin = Path(self.workdir).resolve(), Path(self.flower_bin).resolve()

    def env(self) -> dict[str, str]:
        from frugaltune.allocator import child_env

        return child_env(self.allocator, {
            **os.environ, "PATH": f"{self.flower_bin}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(self.project_root), "FLWR_HOME": str(self.workdir / "flwr_home"),
            "OMP_NUM_THREADS": str(self.threads), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
            "PYTHONUNBUFFERED": "1", **self.extra_env})

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")
        # own process group: stopping a SuperNode also stops the ClientApp process it started; and each dies with
        # the stage (frugaltune/processes.py), which `stop` cannot see to when the stage is killed
        proc = subprocess.Popen(cmd, cwd=self.project_root, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=processes.child_dies_with_parent())
        self.processes[name] = proc
        return proc

    def start_superlink(self) -> None:
        if not self.ports:
            self.ports = {"fleet": free_port(), "control": free_port(), "serverappio": free_port()}
        (self.workdir / "flwr_home").mkdir(parents=True, exist_ok=True)
        (self.workdir / "flwr_home" / "config.toml").write_text(
            '[superlink]\ndefault = "local"\n\n[superlink.local]\n'
            f'address = "127.0.0.1:{self.ports["control"]}"\ninsecure = true\n')
        # No runtime dependency installation: by default the SuperLink `uv sync`s the app's dependencies into a
        # fresh env from the package index at every run; here the apps run in the Flower venv as installed.
        self._spawn("superlink", [str(self.flower_bin / "flower-superlink"), "--insecure",
                                  "--disable-runtime-dependency-installation",
                                  *(["--simulation"] if self.runtime == "simulation" else []),
                                  # state on disk: a restarted SuperLink still knows its SuperNodes and runs
                                  "--database", str(self.workdir / "superlink.db"),
                                  "--fleet-api-address", f"127.0.0.1:{self.ports['fleet']}",
                                  "--control-api-address", f"127.0.0.1:{self.ports['control']}",
                                  "--serverappio-api-address", f"127.0.0.1:{self.ports['serverappio']}"])
        self._wait_listening(self.ports["control"], "superlink")

    def start_supernode(self, index: int) -> None:
        port = self.ports.setdefault(f"clientappio_{index}", free_port())
        self._spawn(f"supernode_{index}", [
            str(self.flower_bin / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{self.ports['fleet']}",
            "--clientappio-api-address", f"127.0.0.1:{port}", "--node-config", config_string(self.node_configs[index])])

    def start(self) -> "LocalFederation":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.start_superlink()
        if self.runtime != "simulation":
            for index in range(len(self.node_configs)):
                self.start_supernode(index)
        return self

    def run_args(self, run_config: dict) -> list[str]:
        """`flwr run`'s arguments; under simulation, the virtual nodes' settings go to a file the run config names
        and the Simulation Engine gets one virtual SuperNode per entry on `workers` Ray workers of `threads` CPUs."""
        args = [str(self.flower_bin / "flwr"), "run"]
        if self.runtime == "simulation":
            listing = self.workdir / "simulation_nodes.json"
            listing.write_text(json.dumps(self.node_configs, indent=1))
            run_config = {**run_config, "simulation-nodes": str(listing)}
            return args + ["--federation-config", config_string({
                "num-supernodes": len(self.node_configs), "client-resources-num-cpus": self.threads,
                "init-args-num-cpus": self.workers * self.threads, "init-args-log-to-driver": True}),
                "--run-config", config_string(run_config)]
        return args + ["--run-config", config_string(run_config)]

    def _wait_listening(self, port: int, name: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.processes[name].poll() is not None:
                raise RuntimeError(f"{name} exited ({self.processes[name].returncode}): "
                                   f"{self.log(name)[-3000:]}")
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.3)
        raise TimeoutError(f"{name} did not listen on 127.0.0.1:{port} within {timeout:.0f}s: {self.log(name)[-3000:]}")

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def submit(self, app_dir: Path, run_config: dict, timeout: float) -> subprocess.CompletedProcess:
        """`flwr run APP local --stream`: returns when the ServerApp has finished (or raises on timeout)."""
        args = self.run_args(run_config)
        return subprocess.run(args[:2] + [str(app_dir), "local", "--stream"] + args[2:], cwd=self.project_root,
                              env=self.env(), capture_output=True, text=True, timeout=timeout)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Kill process `name` and everything it started (its process group and the processes Flower starts in
        sessions of their own): a crash, not a shutdown."""
        proc = self.processes.get(name)
        if proc and proc.poll() is None:
            strays = descendants(proc.pid)
            os.killpg(proc.pid, sig)
            proc.wait(timeout=30)
            processes.end(strays)

    def strays(self) -> list:
        """Live processes of this federation that are none of ours (`flower_processes` of our FLWR_HOME). Flower's
        SuperLink starts each run's `flwr-serverapp` in a session of its own, outside the process group that `stop`
        signals, and it outlives the SuperLink (found idle, 1 GB each, after `make federated`)."""
        ours = {proc.pid for proc in self.processes.values()}
        return [process for process in flower_processes(self.workdir / "flwr_home") if process.pid not in ours]

    def stop(self) -> None:
        for name in list(self.processes):
            proc = self.processes[name]
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.processes.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        processes.end(self.strays())  # found by their environment: our groups are gone, they are not

    def __enter__(self) -> "LocalFederation":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
