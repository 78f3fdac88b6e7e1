"""Where a federation keeps its rounds on disk, in one place for the two sides that use it: the ServerApp writes
them (in the Flower venv) and the federated stage reads them back (in the project's venv, which has no flwr), so
this module imports neither Flower nor torch. Imported, never run.

In a run's `out-dir`: `rounds/round_NNN.safetensors` (the global adapter + head after round NNN; 000 = the seeded
start), `rounds/round_NNN.json` (its evaluation and per-client report) and, with server momentum,
`rounds/velocity_NNN.safetensors` (FedAvgM's velocity after round NNN). The JSON is written last: a round exists
when its JSON does. `replan.json`: the stage's answer after the round it replans at (`replan-after`), read by the
ServerApp before the next round: the rounds the federation ends with (fewer than it started with when the budget
says so).

A client that keeps state between rounds (`federated.client_state: kept`) writes it in its own `state-dir`
(`client_state_NNN.pt` after its round NNN; the stage puts each simulated client's under the run's `clients/`).
"""

from __future__ import annotations

import json
from pathlib import Path


def round_path(out: Path, number: int, suffix: str) -> Path:
    return Path(out) / "rounds" / f"round_{number:03d}.{suffix}"


def velocity_path(out: Path, number: int) -> Path:
    """FedAvgM's velocity after round `number`: named apart from the rounds, which `round_*` globs find."""
    return Path(out) / "rounds" / f"velocity_{number:03d}.safetensors"


def replan_path(out: Path) -> Path:
    return Path(out) / "replan.json"


def replanned_rounds(out: Path) -> int | None:
    """The rounds the stage's replan ends the federation with (None: no answer on disk, or no change)."""
    path = replan_path(out)
    return json.loads(path.read_text()).get("rounds") if path.exists() else None


def number_of(path: Path) -> int:
    """The round number in a file name of this layout (`round_007.json`, `client_state_007.pt` -> 7)."""
    return int(Path(path).stem.rsplit("_", 1)[1])


def completed(out: Path) -> list[int]:
    """The completed rounds' numbers, in order (0 = the start), from their JSONs: a round file without its JSON is
    one a killed server did not finish."""
    return sorted(number_of(path) for path in Path(out).glob("rounds/round_*.json"))


def last_completed_round(out: Path) -> int | None:
    done = completed(out)
    return done[-1] if done else None


def reports(out: Path) -> list[dict]:
    """Every completed round's JSON report, round 0 first."""
    return [json.loads(round_path(out, number, "json").read_text()) for number in completed(out)]


def client_state_path(state_dir: Path, number: int) -> Path:
    return Path(state_dir) / f"client_state_{number:03d}.pt"


def client_state_before(state_dir: Path, number: int) -> Path | None:
    """The newest state a client saved after a round before round `number`, or None. Rounds at or after `number`
    are ignored: a server killed during round `number` resumes it, and the client's first attempt at that round
    must not be where the second one starts."""
    found = sorted((number_of(path), path) for path in Path(state_dir).glob("client_state_*.pt"))
    earlier = [path for saved, path in found if saved < number]
    return earlier[-1] if earlier else None


def prune_client_states(state_dir: Path, keep_from: int) -> None:
    """Remove the states of rounds before `keep_from` (the newest one is all a client starts from)."""
    for path in Path(state_dir).glob("client_state_*.pt"):
        if number_of(path) < keep_from:
            path.unlink(missing_ok=True)
