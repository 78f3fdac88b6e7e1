"""Client-side differential privacy for the federated update: clip the update (trained − received) to an L2 norm,
then add Gaussian noise, with Flower's own DP primitives (flwr.supercore.differential_privacy), the Gaussian
mechanism of Flower's LocalDpMod.

Library code, called by `frugaltune.federated.client_app` when the round's config has `dp-epsilon` > 0 (params
`federated.dp`). LocalDpMod itself is not used as a mod: it requires the reply to carry the same tensors as the
message, and here a client of a smaller rank, or an FFA client (B + head only), replies with other shapes/keys.

What it promises: the update a client sends is (ε, δ)-DP for that one round with respect to any change that moves
the clipped update by at most `clipping_norm` (sensitivity = the clipping norm). What it does not: no accounting
across rounds (ε adds up over the rounds a client takes part in), no protection of the metrics it reports
(num-examples, train-loss), and with a large ε the noise is small.
"""

from __future__ import annotations

import math

import torch
from flwr.supercore.differential_privacy import add_gaussian_noise_inplace, compute_clip_model_update, get_norm


def noise_std(clipping_norm: float, epsilon: float, delta: float) -> float:
    """The Gaussian mechanism's σ for L2 sensitivity `clipping_norm` (as LocalDpMod computes it)."""
    if clipping_norm <= 0 or epsilon <= 0 or not 0 < delta < 1:
        raise ValueError(f"federated.dp: clipping_norm ({clipping_norm}) and epsilon ({epsilon}) must be > 0 and "
                         f"delta ({delta}) in (0, 1).")
    return clipping_norm * math.sqrt(2 * math.log(1.25 / delta)) / epsilon


def privatize(trained: dict[str, torch.Tensor], received: dict[str, torch.Tensor], clipping_norm: float,
              epsilon: float, delta: float) -> tuple[dict[str, torch.Tensor], dict]:
    """`trained` with its update (trained − received, over the tensors it sends) clipped and noised; and what was
    done: the update's norm before clipping and the noise σ."""
    names = list(trained)
    new = [trained[name].detach().cpu().numpy().copy() for name in names]
    old = [received[name].detach().cpu().numpy() for name in names]
    norm = get_norm([n - o for n, o in zip(new, old)])
    compute_clip_model_update(new, old, clipping_norm)
    std = noise_std(clipping_norm, epsilon, delta)
    add_gaussian_noise_inplace(new, std)
    return ({name: torch.from_numpy(array) for name, array in zip(names, new)},
            {"dp-update-norm": round(norm, 6), "dp-noise-std": round(std, 6)})
