"""Secure aggregation (SecAgg+) for one federated round: the server learns the example-weighted mean of the clients'
tensors and nothing about any one client's, with Flower's own protocol (SecAggPlusWorkflow on the server,
secaggplus_mod on the clients).

Library code (the Flower venv), used by `frugaltune.federated.server_app` and `client_app` when the run config has
`secure-aggregation = true` (param `federated.secure_aggregation`).

Flower 1.32 offers SecAgg+ only through its legacy Strategy API: SecAggPlusWorkflow runs inside a `LegacyContext`,
asks `context.strategy.configure_fit` for the round's FitIns and hands the unmasked mean to
`context.strategy.aggregate_fit`; secaggplus_mod gives the ClientApp a FitIns-shaped message (records `fitins.*`) and
expects a FitRes-shaped reply (`fitres.*`), whose parameters it quantizes, weights by num_examples and masks. Our
ServerApp keeps its own round loop (resume, ranks, FFA, bytes), so this module fits one round into that shape: a
one-round Strategy (`OneRound`) that returns the FitIns prepared for the sampled nodes and keeps what the workflow
aggregated, and the client-side reading/writing of the legacy records. Tensors travel as a list, in the order of
the names the server puts in the config (`secure-names` down, `secure-upload` up), every client's update
zero-padded to the global rank: SecAgg+ adds vectors of one shape only.

Costs: four message exchanges per round instead of one (setup, key sharing, masked vectors, unmasking), each a
ClientApp start on a SuperNode; values are clipped to +-`clipping_range` and quantized (2^22 levels over that range,
after weighting by num_examples / max_weight), so the mean carries a small quantization error.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat
from flwr.server import LegacyContext, ServerConfig
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key
from flwr.serverapp import Grid

from frugaltune.federated import wire

FITINS = "fitins.parameters"  # the record secaggplus_mod's FitIns arrives in


# ----- server side


class OneRound(Strategy):
    """The Strategy SecAggPlusWorkflow talks to: it samples nothing (the ServerApp did) and keeps the result."""

    def __init__(self, instructions):
        self.instructions, self.results, self.failures = instructions, [], []

    def initialize_parameters(self, client_manager):
        return None

    def configure_fit(self, server_round, parameters, client_manager):
        return self.instructions

    def aggregate_fit(self, server_round, results, failures):
        self.results, self.failures = results, failures
        return (results[0][1].parameters if results else None), {}

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


def secure_round(grid: Grid, context: Context, nodes: list[int], number: int, tensors: dict[str, torch.Tensor],
                 config: dict, upload: list[str], dtype: str, timeout: float, max_weight: float) -> dict:
    """Run SecAgg+ over `nodes` for round `number`. Returns {"mean": the example-weighted mean of the `upload`
    tensors (None when the protocol halted), "examples": their total, "clients": each reporting client's metrics
    with its node id, "bytes_down": the global's serialized size sent to each client}."""
    names = sorted(tensors)
    parameters = ndarrays_to_parameters([wire.encode(tensors[name], dtype) for name in names])
    fit_config = {**config, "secure-names": json.dumps(names), "secure-upload": json.dumps(upload)}
    strategy = OneRound([(GridClientProxy(node, grid, grid.run.run_id), FitIns(parameters, fit_config))
                         for node in nodes])
    legacy = LegacyContext(context, config=ServerConfig(num_rounds=1), strategy=strategy)
    legacy.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(parameters, True)
    legacy.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({Key.CURRENT_ROUND: number})
    # num_shares 1.0: every sampled client holds a share of every other's key; half of them can unmask a client
    # that dropped after its masked vector was sent
    SecAggPlusWorkflow(num_shares=1.0, reconstruction_threshold=0.5, max_weight=max_weight, timeout=timeout)(
        grid, legacy)
    result = {"mean": None, "examples": 0, "clients": [], "bytes_down": sum(len(t) for t in parameters.tensors)}
    if strategy.results:
        mean = parameters_to_ndarrays(strategy.results[0][1].parameters)
        result.update(mean={name: torch.from_numpy(np.asarray(array, dtype=np.float32).copy())
                            for name, array in zip(upload, mean)},
                      examples=sum(res.num_examples for _, res in strategy.results),
                      clients=[{"node": proxy.node_id, **dict(res.metrics)} for proxy, res in strategy.results])
    return result


# ----- client side


def secure_when_asked(msg: Message, context: Context, call_next) -> Message:
    """A ClientApp mod: SecAgg+'s messages go through Flower's secaggplus_mod, every other message straight on
    (secaggplus_mod alone would refuse a train message without its protocol records)."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


def is_fitins(msg: Message) -> bool:
    return FITINS in msg.content.array_records


def read_fitins(msg: Message) -> tuple[dict[str, torch.Tensor], dict, int]:
    """(the global tensors by name, the round's config, the bytes received) from a FitIns-shaped message."""
    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    names = json.loads(str(fitins.config["secure-names"]))
    arrays = parameters_to_ndarrays(fitins.parameters)
    return ({name: wire.decode(array) for name, array in zip(names, arrays)}, dict(fitins.config),
            sum(len(t) for t in fitins.parameters.tensors))


def fitres_reply(msg: Message, tensors: dict[str, torch.Tensor], config: dict, num_examples: int,
                 metrics: dict) -> Message:
    """The FitRes-shaped reply secaggplus_mod masks: the tensors in `secure-upload` order, as fp32 (it quantizes
    them itself; bf16 would only lose precision before that)."""
    upload = json.loads(str(config["secure-upload"]))
    parameters: Parameters = ndarrays_to_parameters([tensors[name].detach().float().numpy() for name in upload])
    # what this client hands to secaggplus_mod; the masked vector it sends is of the same length in integers
    metrics = {**metrics, "bytes-up": sum(len(t) for t in parameters.tensors), "secure-aggregation": 1}
    res = FitRes(Status(Code.OK, ""), parameters, num_examples, metrics)
    return Message(compat.fitres_to_recorddict(res, keep_input=True), reply_to=msg)
