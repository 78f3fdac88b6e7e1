"""The federation's typed settings and their one mapping to and from Flower's flat configs
(frugaltune/federated/settings.py): a round trip keeps every value, the Flower App's declared keys and defaults are
the settings', a round's settings carry the round's lr, and what Flower adds is ignored.
Run with `pytest tests/unit/test_federated_settings.py` (no Flower needed)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError

from frugaltune.federated.launch import toml_value
from frugaltune.federated.settings import NodeSettings, RoundSettings, RunSettings

APP_TOML = Path(__file__).resolve().parents[2] / "frugaltune/federated/flower_app/pyproject.toml"


def as_flower_parses_it(config: dict) -> dict:
    """The values as `flwr run --run-config` / `--node-config` hands them to the apps: each written by the launcher
    (launch.toml_value) and read back as TOML."""
    return tomllib.loads("\n".join(f'"{key}" = {toml_value(value)}' for key, value in config.items()))


def a_run() -> RunSettings:
    return RunSettings(out_dir="/tmp/run", labels=["neg", "neu", "pos"], pad_token_id=2, num_rounds=7, fraction=0.3,
                       method="ffa", lora_r=16, lora_alpha=32, lora_target_modules=["q_proj", "v_proj"], lr=0.002,
                       server_momentum=0.5, lr_schedule="linear", dp_epsilon=10.0, logit_adjustment=True,
                       client_state="kept", transmit_dtype="bf16", secure_aggregation=True, precision="bf16",
                       secure_max_weight=640.0, simulation_nodes="/tmp/nodes.json")


def test_a_run_config_survives_the_trip_through_flower():
    settings = a_run()
    config = settings.to_flower()
    assert all(isinstance(value, (str, int, float, bool)) for value in config.values())  # Flower's values
    assert config["labels"] == json.dumps(["neg", "neu", "pos"]) and config["lora-target-modules"] == json.dumps(
        ["q_proj", "v_proj"])
    assert config["num-rounds"] == 7 and config["lr-schedule"] == "linear" and config["secure-aggregation"] is True
    assert RunSettings.from_flower(as_flower_parses_it(config)) == settings
    assert settings.lora().target_modules == ("q_proj", "v_proj") and settings.lora().r == 16


def test_the_flower_app_declares_exactly_the_settings_keys_with_their_defaults():
    """Flower accepts only the run-config keys the App's pyproject.toml declares: the two lists must be the same,
    and its defaults the settings' defaults (one source of the values, checked)."""
    declared = tomllib.loads(APP_TOML.read_text())["tool"]["flwr"]["app"]["config"]
    assert set(declared) == set(RunSettings().to_flower())
    assert RunSettings.from_flower(declared) == RunSettings()


def test_a_round_carries_the_runs_training_settings_and_the_rounds_lr():
    settings = a_run()
    first, last = settings.for_round(1), settings.for_round(7)
    assert first.lr == pytest.approx(0.002 * (1 - 0.5 / 7)) and last.lr == pytest.approx(0.002 * 0.5 / 7)
    assert (first.round, first.method, first.lora_r, first.client_state) == (1, "ffa", 16, "kept")
    assert first.head_lr == 0.0  # unset: the head trains at the round's lr
    headed = settings.model_copy(update={"head_lr": 0.004}).for_round(7)
    assert headed.head_lr == pytest.approx(0.004 * 0.5 / 7) and headed.lr == last.lr  # decayed as lr is
    # SecAgg+ adds its own keys to the config a client reads: ignored
    received = {**as_flower_parses_it(last.to_flower()), "secure-names": "[]", "secure-upload": "[]"}
    assert RoundSettings.from_flower(received) == last
    assert "out-dir" not in last.to_flower()  # a client gets only what its training reads


def test_node_settings_leave_out_what_is_unset_and_read_a_simulated_nodes_keys():
    node = NodeSettings(data="/data/client_3.parquet", lora_rank=4, local_steps=2, client_id=3, threads=2)
    config = node.to_flower()
    assert "micro-batch" not in config and "state-dir" not in config  # a Flower config has no null
    assert NodeSettings.from_flower(as_flower_parses_it(config)) == node
    simulated = NodeSettings.from_flower({"partition-id": 1, "num-partitions": 3})
    assert simulated.partition_id == 1 and simulated.data is None and simulated.precision == "fp32"


def test_a_malformed_value_is_refused_with_its_key():
    with pytest.raises(ValidationError, match="round-timeout"):
        RunSettings.from_flower({"round-timeout": "not a number"})
    with pytest.raises(ValidationError, match="lr-schedule"):
        RunSettings.from_flower({"lr-schedule": "step"})
