"""Aggregation of LoRA adapters + classification head across clients (pure torch; no Flower import).

Library code, called by `frugaltune.federated.server_app` each round; unit-tested in tests/unit/test_federated.py.

Two methods:
- `fedavg`: every trainable tensor (lora_A, lora_B, head) averaged, weighted by the client's examples. For LoRA
  this is inexact: the global update is mean(B_i) @ mean(A_i), not mean(B_i @ A_i) (the average of products is not
  the product of averages); `product_error` measures by how much.
- `ffa` (FFA-LoRA, Sun et al. 2024): lora_A stays frozen at the shared seeded initialisation the server sends; only
  B and the head train and travel back. With A common to all, mean(B_i) @ A == mean(B_i @ A): the average is exact.

Clients may use different LoRA ranks (a laptop r=4, a GPU server r=16). The global adapter has the largest rank R:
a client of rank r receives the first r rows of each A and the first r columns of each B; its reply is zero-padded
back to R before averaging (HetLoRA-style). Because every client's alpha is scaled with its rank (alpha/r constant,
`client_alpha`), the zero-padded B_i @ A equals the client's own B_i[:, :r] @ A[:r], so under FFA the aggregate is
still exactly the weighted mean of the clients' weight deltas.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

import torch

Tensors = Mapping[str, torch.Tensor]


def is_lora_a(name: str) -> bool:
    return ".lora_A." in name


def is_lora_b(name: str) -> bool:
    return ".lora_B." in name


def client_alpha(global_alpha: int, global_rank: int, client_rank: int) -> int:
    """Alpha for a client of `client_rank` that keeps the global scale alpha/r (so padded deltas agree)."""
    scaled = global_alpha * client_rank / global_rank
    if scaled != int(scaled):
        raise ValueError(f"federated: lora alpha {global_alpha} / rank {global_rank} gives a non-integer alpha "
                         f"{scaled} for a rank-{client_rank} client; choose alpha as a multiple of the rank.")
    return int(scaled)


def slice_to_rank(tensors: Tensors, rank: int) -> dict[str, torch.Tensor]:
    """The global adapter cut to a client of `rank`: A (R, in) -> (rank, in); B (out, R) -> (out, rank)."""
    out = {}
    for name, tensor in tensors.items():
        if is_lora_a(name):
            out[name] = tensor[:rank].clone()
        elif is_lora_b(name):
            out[name] = tensor[:, :rank].clone()
        else:
            out[name] = tensor.clone()
    return out


def pad_to_rank(tensors: Tensors, rank: int) -> dict[str, torch.Tensor]:
    """A client's adapter zero-padded to `rank` (the inverse of `slice_to_rank` on the client's own rows/cols)."""
    out = {}
    for name, tensor in tensors.items():
        if is_lora_a(name) and tensor.shape[0] < rank:
            out[name] = torch.cat([tensor, tensor.new_zeros(rank - tensor.shape[0], tensor.shape[1])], 0)
        elif is_lora_b(name) and tensor.shape[1] < rank:
            out[name] = torch.cat([tensor, tensor.new_zeros(tensor.shape[0], rank - tensor.shape[1])], 1)
        elif (tensor.shape[0] if is_lora_a(name) else tensor.shape[-1] if is_lora_b(name) else 0) > rank:
            raise ValueError(f"{name}: a client sent a rank above the global rank {rank}; set the global LoRA rank "
                             "(federated.lora.r) to the largest client rank.")
        else:
            out[name] = tensor
    return out


def weighted_mean(updates: Sequence[tuple[Tensors, int]]) -> dict[str, torch.Tensor]:
    """Σ_i n_i x_i / Σ_i n_i for every tensor name the clients sent (all must send the same names and shapes)."""
    if not updates:
        raise ValueError("federated: no client update to aggregate (every sampled client failed).")
    total = sum(n for _, n in updates)
    if total <= 0:
        raise ValueError("federated: the clients reported 0 examples in total; nothing to weight by.")
    names = set(updates[0][0])
    for tensors, _ in updates[1:]:
        if set(tensors) != names:
            raise ValueError(f"federated: clients sent different tensors: {sorted(names ^ set(tensors))[:4]}")
    return {name: sum(t[name].double() * (n / total) for t, n in updates).to(updates[0][0][name].dtype)
            for name in sorted(names)}


def aggregate(global_tensors: Tensors, updates: Sequence[tuple[Tensors, int]], method: str) -> dict[str, torch.Tensor]:
    """The next global adapter from `global_tensors` (rank R) and the clients' (tensors, num_examples).

    `fedavg`: every tensor, each client zero-padded to R, weighted mean. `ffa`: the clients send B and the head only;
    A is kept from `global_tensors` (frozen everywhere), B and the head are the weighted mean.
    """
    rank = max((t.shape[0] for n, t in global_tensors.items() if is_lora_a(n)), default=0)
    padded = [(pad_to_rank(tensors, rank), n) for tensors, n in updates]
    if method == "fedavg":
        mean = weighted_mean(padded)
    elif method == "ffa":
        stray = [name for tensors, _ in padded for name in tensors if is_lora_a(name)]
        if stray:
            raise ValueError(f"federated.method ffa: a client sent lora_A ({stray[0]}); under FFA-LoRA A is frozen "
                             "and must not travel back. Is the client running another method?")
        mean = weighted_mean(padded)
        mean.update({name: t for name, t in global_tensors.items() if is_lora_a(name)})
    else:
        raise ValueError(f"federated.method: {method!r} is not one of 'fedavg', 'ffa'.")
    missing = set(global_tensors) - set(mean)
    if missing:
        raise ValueError(f"federated: the clients did not send {sorted(missing)[:3]} (of {len(missing)} missing).")
    for name, tensor in mean.items():
        if name in global_tensors and tensor.shape != global_tensors[name].shape:
            raise ValueError(f"{name}: aggregated shape {tuple(tensor.shape)} != global {tuple(global_tensors[name].shape)}")
    return {name: mean[name] for name in global_tensors}


def server_step(global_tensors: Tensors, aggregated: Tensors, server_lr: float) -> dict[str, torch.Tensor]:
    """FedAvg with a server learning rate (Reddi et al., 2021, "Adaptive Federated Optimization", SGD on the server):
    global + server_lr * (aggregated - global). 1 is plain FedAvg. Why > 1: clients that start a round from the same
    point and take k steps each move the mean about k steps' worth, not (clients x k): per example seen, a round
    makes a fraction of the progress of one process training on the same examples; the server step scales it back.
    Under FFA A does not change (aggregated A is the global A), so B's step stays exact."""
    if server_lr <= 0:
        raise ValueError(f"federated.server_lr = {server_lr}: must be > 0 (1 = plain FedAvg).")
    if server_lr == 1:
        return dict(aggregated)
    return {name: (global_tensors[name].double() + server_lr * (aggregated[name].double()
                                                                - global_tensors[name].double())).to(tensor.dtype)
            for name, tensor in aggregated.items()}


def server_momentum_step(global_tensors: Tensors, aggregated: Tensors, server_lr: float, momentum: float,
                         velocity: Tensors | None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """FedAvgM (Hsu et al., 2019, proposed for Dirichlet label skew): v = momentum * v + (aggregated - global);
    global + server_lr * v. Returns (next global, v). The rounds' client samples differ in their label mix, so one
    round's mean update leans toward the labels its clients hold; v averages those leanings over rounds while the
    direction every round agrees on adds up. `momentum` 0 is `server_step`. Under FFA, A's delta is 0 every round,
    so A stays the shared one and the step stays exact. v lives in fp32 (kept on disk by the ServerApp)."""
    if not 0 <= momentum < 1:
        raise ValueError(f"federated.server_momentum = {momentum}: must be in [0, 1) (0 = no momentum).")
    if momentum == 0:  # no state; plain FedAvg stays bit-exact (the clients' mean itself at server_lr 1)
        return server_step(global_tensors, aggregated, server_lr), {}
    if server_lr <= 0:
        raise ValueError(f"federated.server_lr = {server_lr}: must be > 0 (1 = plain FedAvg).")
    velocity = dict(velocity or {})
    new, moved = {}, {}
    for name, tensor in aggregated.items():
        delta = aggregated[name].float() - global_tensors[name].float()
        moved[name] = momentum * velocity[name].float() + delta if name in velocity else delta
        new[name] = (global_tensors[name].float() + server_lr * moved[name]).to(tensor.dtype)
    return new, moved


def sample_clients(nodes: Sequence[int], client_ids: Mapping[int, int | None], count: int, seed: int,
                   number: int) -> list[int]:
    """Round `number`'s sample of `count` nodes, drawn from the nodes ordered by client id (then, for nodes without
    one, by node id): Flower's node ids are random per run, client ids are the plan's, so every run of a federation
    samples the same clients in each round. The ServerApp and benchmarks/federated_rounds.py both draw with it."""
    ordered = sorted(nodes, key=lambda node: (client_ids.get(node) is None, client_ids.get(node) or 0, node))
    return random.Random(seed * 1000 + number).sample(ordered, min(count, len(ordered)))


def round_lr(lr: float, number: int, num_rounds: int, schedule: str) -> float:
    """The clients' learning rate in round `number` (1-based) of `num_rounds`: `constant`, or the `linear` / `cosine`
    decay of centralized training sampled at the middle of the round, so a federation ends, as one process does,
    with small steps around the point it reached instead of each client's last steps at the full rate."""
    if not 1 <= number <= num_rounds:
        raise ValueError(f"round {number} is outside 1..{num_rounds}")
    progress = (number - 0.5) / num_rounds
    if schedule == "constant":
        return lr
    if schedule == "linear":
        return lr * (1.0 - progress)
    if schedule == "cosine":
        return lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"federated.lr_schedule: {schedule!r} is not one of 'constant', 'linear', 'cosine'.")


def lora_pairs(tensors: Tensors) -> list[tuple[str, str]]:
    """(A name, B name) for every adapted layer."""
    return [(name, name.replace(".lora_A.", ".lora_B.")) for name in sorted(tensors) if is_lora_a(name)]


def product_error(global_tensors: Tensors, updates: Sequence[tuple[Tensors, int]]) -> float:
    """Relative error ||B̄Ā − mean(B_i A_i)|| / ||mean(B_i A_i)|| of the aggregate, summed over layers: 0 for FFA.

    `updates` are the clients' full adapters (A and B; under FFA their A is the global one)."""
    total = sum(n for _, n in updates)
    num = den = 0.0
    for a_name, b_name in lora_pairs(global_tensors):
        exact = sum((pad_to_rank(t, global_tensors[a_name].shape[0])[b_name].double()
                     @ pad_to_rank(t, global_tensors[a_name].shape[0])[a_name].double()) * (n / total)
                    for t, n in updates)
        approx = global_tensors[b_name].double() @ global_tensors[a_name].double()
        num += float(torch.linalg.norm(approx - exact)) ** 2
        den += float(torch.linalg.norm(exact)) ** 2
    return (num ** 0.5) / (den ** 0.5) if den > 0 else 0.0
