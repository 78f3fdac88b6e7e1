"""Start the Prefect server and the MLflow UI on 127.0.0.1, print both URLs; Ctrl-C stops both.  Run with:

    make ui                # = python -m flows.ui [--prefect-port 4200] [--mlflow-port 5000]
    make ui SERVER=1       # = python -m flows.ui --mlflow-server: an MLflow tracking server instead of the UI
    make mlflow-server     # = python -m flows.ui --mlflow-server --no-prefect: that server alone

Prefect keeps its SQLite database in the project's `.prefect/` (gitignored) unless PREFECT_HOME is set. MLflow
shows the project's store (`mlflow.db`, artifacts in `mlartifacts/`); when MLFLOW_TRACKING_URI names a server,
that server is the UI and none is started here. Then, in another terminal, `make serve` serves the flow.

`--mlflow-server` starts `mlflow server` instead: a tracking server with its own store in `mlflow-server/`
(sqlite, gitignored) that proxies artifacts, so clients upload and download them over HTTP and never read the
server's disk. Point every stage, the flow and `frugaltune predict` at it with the
`export MLFLOW_TRACKING_URI=http://127.0.0.1:5000` it prints. It does not serve the project's `mlflow.db`: the
experiments there keep their artifacts at `file://` paths, which only this machine can read.

Both servers run in their own process groups, so Ctrl-C (or SIGTERM/SIGHUP) reaches this launcher only, and it
stops each whole group in turn: first SIGTERM, then SIGKILL after a grace period. Nothing outlives it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"  # loopback only: neither UI has authentication
PREFECT_PORT = 4200
MLFLOW_PORT = 5000
STARTUP_TIMEOUT_S = 180  # both start in 10-30 s on a busy 2-core machine
STOP_GRACE_S = 15


def prefect_api_url(port: int = PREFECT_PORT) -> str:
    return f"http://{HOST}:{port}/api"


def mlflow_ui_url(port: int = MLFLOW_PORT) -> str:
    return f"http://{HOST}:{port}"


def mlflow_server_cmd(port: int = MLFLOW_PORT, store: Path | None = None) -> list[str]:
    """`mlflow server` on HOST:port: sqlite in `store` (default `mlflow-server/`), artifacts under it, proxied.

    `--serve-artifacts` (MLflow's default, spelled out): new experiments get `mlflow-artifacts:/` locations, so
    clients on any machine log and load artifacts through the server. For a team, swap the sqlite URI for a
    database server and `--artifacts-destination` for a bucket (s3://, gs://); the clients do not change.
    """
    from frugaltune import paths

    store = (store or paths.MLFLOW_SERVER_DIR).resolve()
    return [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}",
            "--serve-artifacts", "--artifacts-destination", (store / "artifacts").as_uri(),
            "--host", HOST, "--port", str(port), "--workers", "1"]


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex((HOST, port)) != 0


def start(name: str, cmd: list[str], env: dict[str, str], log: Path | None = None) -> subprocess.Popen:
    """Start a server in its own process group (its output to `log`, else to this terminal)."""
    out = open(log, "ab") if log else None  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                            start_new_session=True)
    if out:
        out.close()
    print(f"{name}: started (pid {proc.pid})", flush=True)
    return proc


def wait_until_up(name: str, proc: subprocess.Popen, health_url: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode} while starting (see its output above)")
        try:
            with urllib.request.urlopen(health_url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name} did not answer {health_url} within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL if it is still there after STOP_GRACE_S."""
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        # The leader is gone; workers it forked (uvicorn, MLflow's job runners) may linger a moment.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        break


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Prefect server + MLflow UI on 127.0.0.1 until Ctrl-C.")
    parser.add_argument("--prefect-port", type=int, default=PREFECT_PORT)
    parser.add_argument("--mlflow-port", type=int, default=MLFLOW_PORT)
    parser.add_argument("--log-dir", type=Path, help="write the servers' output here instead of to the terminal")
    parser.add_argument("--mlflow-server", action="store_true",
                        help="start an MLflow tracking server (store in mlflow-server/, artifacts proxied) instead "
                        "of the read-only UI; runs reach it with MLFLOW_TRACKING_URI=http://127.0.0.1:<port>")
    parser.add_argument("--no-prefect", dest="prefect", action="store_false", help="start MLflow only")
    args = parser.parse_args(argv)

    from frugaltune import paths, tracking  # light imports; after argparse so that --help is instant

    env = dict(os.environ)
    env.setdefault("PREFECT_HOME", str(Path(".prefect").resolve()))
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry from a local server
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")  # GenAI job runners: not used, 7 processes
    env.pop("PREFECT_API_URL", None)  # the server must not try to reach another one
    store = tracking.tracking_uri()
    remote_mlflow = tracking.is_server(store) and not args.mlflow_server
    if remote_mlflow:  # that server is the UI: a link to a server that is down would be a dead end
        from frugaltune.store import StoreUnreachable, check_server

        try:
            check_server(store)
        except StoreUnreachable as exc:
            print(f"ui: {exc}", file=sys.stderr)
            return 1
    if not args.prefect and remote_mlflow:
        print(f"ui: --no-prefect leaves nothing to start: MLFLOW_TRACKING_URI names a server ({store}). Add "
              "--mlflow-server to start one here.", file=sys.stderr)
        return 1
    wanted = ([args.prefect_port] if args.prefect else []) + ([] if remote_mlflow else [args.mlflow_port])
    busy = [port for port in wanted if not _port_free(port)]
    if busy:
        print(f"ui: port {busy[0]} on {HOST} is in use (another `make ui`?). Stop it or pick another port with "
              "--prefect-port / --mlflow-port.", file=sys.stderr)
        return 1
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)

    # Started in the background (nohup, `&` in a script), a process inherits SIGINT *ignored* and Python then
    # installs no KeyboardInterrupt handler: restore it so that Ctrl-C / `kill -INT` always stops the servers.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        if args.prefect:
            prefect_cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", HOST,
                           "--port", str(args.prefect_port)]
            # The Prefect UI asks its API at PREFECT_UI_API_URL, which defaults to port 4200 whatever --port says.
            prefect_env = {**env, "PREFECT_UI_API_URL": prefect_api_url(args.prefect_port)}
            servers["Prefect"] = (start("Prefect", prefect_cmd, prefect_env,
                                        args.log_dir and args.log_dir / "prefect.log"),
                                  f"http://{HOST}:{args.prefect_port}/api/health")
        if args.mlflow_server:
            paths.MLFLOW_SERVER_DIR.mkdir(exist_ok=True)  # sqlite makes the file, not its folder
            servers["MLflow"] = (start("MLflow", mlflow_server_cmd(args.mlflow_port), env,
                                       args.log_dir and args.log_dir / "mlflow.log"),
                                 f"{mlflow_ui_url(args.mlflow_port)}/health")
        elif not remote_mlflow:
            mlflow_cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", store, "--host", HOST,
                          "--port", str(args.mlflow_port), "--workers", "1"]
            servers["MLflow"] = (start("MLflow", mlflow_cmd, env, args.log_dir and args.log_dir / "mlflow.log"),
                                 f"{mlflow_ui_url(args.mlflow_port)}/health")
        for name, (proc, health) in servers.items():
            wait_until_up(name, proc, health)
        print()
        if args.prefect:
            print(f"Prefect UI: http://{HOST}:{args.prefect_port}   (flows: PREFECT_API_URL="
                  f"{prefect_api_url(args.prefect_port)}; `make serve` uses it)", flush=True)
        if args.mlflow_server:
            print(f"MLflow tracking server: {mlflow_ui_url(args.mlflow_port)}   (store: "
                  f"{paths.MLFLOW_SERVER_DIR}/, artifacts proxied). In every terminal that runs stages, the flow "
                  f"or `frugaltune predict`:\n  export MLFLOW_TRACKING_URI={mlflow_ui_url(args.mlflow_port)}",
                  flush=True)
        else:
            print(f"MLflow UI:  {store if remote_mlflow else mlflow_ui_url(args.mlflow_port)}"
                  f"{'   (remote, from MLFLOW_TRACKING_URI)' if remote_mlflow else ''}", flush=True)
            if not remote_mlflow:  # each task's runs table, straight in model-training mode with its columns
                for name, url in tracking.runs_links(store, mlflow_ui_url(args.mlflow_port)):
                    print(f"  runs of {name}: {url}", flush=True)
        print("Ctrl-C stops both." if len(servers) == 2 else "Ctrl-C stops it.", flush=True)
        while True:
            for name, (proc, _) in servers.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with code {proc.returncode}")
            time.sleep(1)
    except KeyboardInterrupt:
        print("\nui: stopping...", flush=True)
        return 0
    except RuntimeError as exc:
        print(f"ui: {exc}; stopping the other server", file=sys.stderr, flush=True)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the shutdown short
            signal.signal(sig, signal.SIG_IGN)
        for name, (proc, _) in servers.items():
            stop(proc)
            print(f"{name}: stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
