"""The Flower ClientApp: one federated client trains the LoRA adapter + head on its own partition and sends back
only the trainable tensors.

Run by a SuperNode (the Flower venv), never directly:
    .venv-flower/bin/flower-supernode --insecure --superlink HOST:9092 --clientappio-api-address 127.0.0.1:9094 \
        --node-config "data='data/federated/partitions/client_0.parquet' lora-rank=4 threads=1"
with PYTHONPATH at the project root, after the ServerApp is started by `flwr run` (see README "Federated
fine-tuning"). The node config is what this machine owns: `data` (its tokenized rows, parquet: input_ids, labels;
they never leave it), optionally `model-dir` (its copy of the base model; default: the server's path),
`lora-rank` (<= the global rank; default the global rank), `micro-batch`, `local-steps` (its plan's, which a round
budget may lower; default the run's), `threads`, `precision` (fp32 | bf16: what this machine measured faster;
default fp32), `eager-attention-max-len` and `int8-products` (its plan's; default 0 and false) and `state-dir`
(where it keeps its optimizer's moments between rounds when the run's `client-state` is `kept`; without it the
client starts each round fresh and says so in its metrics). These keys are settings.NodeSettings; a round's
settings arrive with its message as settings.RoundSettings.

In Flower's Simulation Engine (the `federated` stage's default on one machine) a virtual node's config is only its
`partition-id`; the same keys then come from the run config's `simulation-nodes` (a JSON list, one entry per
partition, written by the stage). Its workers (Ray actors) run many ClientApp calls in one process, so the base
model is built once per worker and rank and each call only overwrites its trainable tensors with the global ones
(`local.cached_model`); a deployment starts a process per message and builds it every time.

Before its first round the server sends each node a `query.identify` message; the reply names which client of
the plan it is (its `client-id` or `partition-id`), so the server samples the same clients in every run.

Each train message carries the global adapter (ArrayRecord "arrays") and the round's settings (ConfigRecord
"config"). The reply carries the trained tensors and MetricRecord "metrics": num-examples (the FedAvg weight),
train-loss, bytes-down / bytes-up (the serialized Array payloads, exactly what the record carries; halved with
`transmit-dtype` bf16, both ways), seconds, peak RSS (this round's: the high-water mark is reset when the message
arrives, `peak-rss-of-round`), mimalloc (1 when the process runs on it); with
`dp-epsilon` > 0 the update is clipped and noised first (frugaltune/federated/privacy.py) and dp-update-norm /
dp-noise-std say how. With the run's `secure-aggregation` on, the round arrives as Flower's SecAgg+ protocol
messages (frugaltune/federated/secure.py): the same training, the reply masked by secaggplus_mod.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from frugaltune import allocator
from frugaltune.federated import aggregation, local, rounds, secure, wire
from frugaltune.federated.settings import NodeSettings, RoundSettings, RunSettings
from frugaltune.training.loop import peak_rss_mb, reset_peak_rss

# SecAgg+'s protocol messages go through Flower's secaggplus_mod; the others straight to `train`
app = ClientApp(mods=[secure.secure_when_asked])


def record_bytes(record: ArrayRecord) -> int:
    """Bytes of the serialized tensors in `record` (each Array's payload: the .npy bytes Flower sends)."""
    return sum(len(array.data) for array in record.values())


def to_record(tensors: dict[str, torch.Tensor], dtype: wire.TransmitDtype = "fp32") -> ArrayRecord:
    """The tensors as Flower Arrays, fp32 or as bf16 bit patterns (frugaltune/federated/wire.py)."""
    return ArrayRecord({name: Array(wire.encode(tensor, dtype)) for name, tensor in tensors.items()})


def from_record(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return {name: wire.decode(array.numpy()) for name, array in record.items()}


def node_settings(context: Context) -> NodeSettings:
    """This node's settings: its --node-config in a deployment; under the Simulation Engine, the entry for its
    `partition-id` in the run config's `simulation-nodes` file (the node config wins where both have a key)."""
    node = dict(context.node_config)
    listing = RunSettings.from_flower(context.run_config).simulation_nodes
    if "data" not in node and "partition-id" in node and listing:
        entries = json.loads(Path(listing).read_text())
        index = int(node["partition-id"])
        if index >= len(entries):
            raise ValueError(f"simulation node {index}: {listing} lists {len(entries)} nodes; start the simulation "
                             f"with num-supernodes = {len(entries)}")
        node = {**entries[index], **node}
    return NodeSettings.from_flower(node)


@app.query("identify")
def identify(msg: Message, context: Context) -> Message:
    """Which client of the federation this node is: `client-id` of its settings (the stage's plan), else its
    simulation `partition-id`; none for a node started without either. The server orders its sample by it, because
    Flower draws node ids at random each time a SuperNode starts: sampled by node id, two runs of the same
    federation trained different clients in each round. Builds no model (a deployment pays one process start)."""
    node = node_settings(context)
    key = node.client_id if node.client_id is not None else node.partition_id
    return Message(RecordDict({"metrics": MetricRecord({} if key is None else {"client-id": int(key)})}),
                   reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    started = time.perf_counter()
    # this round's own peak: a simulation worker runs client after client, and its lifetime peak is the largest's
    own_peak = reset_peak_rss()
    node = node_settings(context)
    legacy = secure.is_fitins(msg)  # SecAgg+: the global and config arrive as a FitIns, the reply is a FitRes
    if legacy:
        received, config, bytes_down = secure.read_fitins(msg)
    else:
        config, incoming = msg.content["config"], msg.content["arrays"]
        received, bytes_down = from_record(incoming), record_bytes(incoming)
    settings = RoundSettings.from_flower(config)
    torch.set_num_threads(node.threads)
    spec = settings.lora()
    rank = node.lora_rank or spec.r
    if node.data is None:
        raise ValueError("this SuperNode has no `data` in its --node-config: start it with "
                         "--node-config \"data='path/to/client.parquet'\"")
    input_ids, targets = local.read_examples(node.data)

    bf16 = node.precision == "bf16"
    model, reused = local.cached_model(node.model_dir or settings.model_dir, list(settings.labels),
                                       settings.pad_token_id, settings.seed, spec, rank, bf16, node.int8_products)
    number = settings.round
    state_dir = Path(node.state_dir) if node.state_dir is not None else None
    kept = settings.client_state == "kept" and state_dir is not None
    moments: dict | None = None
    resumed = False
    if kept:  # AdamW's moments from this client's last round, continued (federated.client_state: kept)
        previous = rounds.client_state_before(state_dir, number)
        moments = torch.load(previous, weights_only=True) if previous else {}
        resumed = bool(moments)
    trained, result, privacy = local.train_round(
        model, received, rank, settings, input_ids, targets, local_steps=node.local_steps,
        micro_batch_size=node.micro_batch, bf16=bf16, eager_attention_max_len=node.eager_attention_max_len,
        optimizer_state=moments)
    if kept:
        state_dir.mkdir(parents=True, exist_ok=True)
        saved = rounds.client_state_path(state_dir, number)
        torch.save(moments, saved.with_suffix(".tmp"))
        saved.with_suffix(".tmp").replace(saved)  # whole or absent: a killed client leaves no half state
        rounds.prune_client_states(state_dir, number)
    metrics = {**privacy,
        "num-examples": len(targets), "train-loss": float(result.final_loss), "steps": result.steps,
        "bytes-down": bytes_down, "lora-rank": rank, "model-reused": int(reused),
        "seconds": round(time.perf_counter() - started, 3), "peak-rss-mb": round(peak_rss_mb(), 1),
        "peak-rss-of-round": int(own_peak),  # 0: the process's peak so far (the kernel refused the reset)
        "client-state-kept": int(kept), "client-state-resumed": int(resumed),
        # which malloc this client trained on (its time and memory depend on it; the launcher sets it)
        "mimalloc": int(allocator.active() == "mimalloc"),
        # which client of the stage's plan this is (node ids are Flower's own), for the plan-vs-measured report
        **({"client-id": node.client_id} if node.client_id is not None else {})}
    if legacy:  # zero-padded to the global rank: SecAgg+ sums vectors of one shape
        return secure.fitres_reply(msg, aggregation.pad_to_rank(trained, spec.r), config, len(targets), metrics)
    outgoing = to_record(trained, settings.transmit_dtype)
    metrics["bytes-up"] = record_bytes(outgoing)
    return Message(RecordDict({"arrays": outgoing, "metrics": MetricRecord(metrics)}), reply_to=msg)
