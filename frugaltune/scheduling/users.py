"""Users and their runtime estimates for a generated workload: who submits each job, and what wall-clock limit.

Library code: `with_users(lublin_workload(10_000, 256, seed=7), UserModel(), seed=7)` -> the same jobs (submit
times, sizes, run times unchanged) with a user id, a group id and a requested time each. The scheduling pipeline's
`generate_workload` stage calls it with `scheduling.workload.users` (and `scheduling.second_workload.users`).

Why: the Lublin-Feitelson model has no estimates (requested time = run time), so a scheduler fed it knows every
job's length, which no real one does. Real estimates, after D. Tsafrir, Y. Etsion and D. G. Feitelson, "Modeling
user runtime estimates" (JSSPP 2005), are *modal* (about 20 round values, such as 5 min, 15 min, 1 h, 4 h, cover
about 90% of the jobs; the machine's maximum is among the most popular), never below the run time (the system
kills a job at its estimate), and of very different accuracy for different users. This module keeps those features;
it is not the paper's exact fitting procedure:

- **Users** (`users`, `zipf`): user k (k = 1..users) submits with an activity proportional to k^-zipf, and has a
  characteristic job shape: a template job drawn from the workload itself. A job goes to user u with probability
  proportional to activity_u x exp(-d^2 / 2 shape_spread^2), d being the distance between the job and u's
  template in (ln run time, log2 processors), each scaled by its standard deviation over the workload. So the
  model's marginals stay exactly Lublin's, while a user's jobs look alike (what makes a user's history predictive,
  as Tsafrir, Etsion & Feitelson's TPDS 2007 predictor assumes). Groups: user u is in group u mod `groups`.
- **Estimates**: user u has a mean accuracy (run time / estimate) m_u ~ Beta(accuracy_a, accuracy_b) and a
  propensity q_u ~ Beta with mean `max_estimate_share` (concentration 2) to ask for the maximum. A job of u asks
  for the maximum with probability q_u; otherwise its accuracy is a ~ Beta with mean m_u and concentration
  `accuracy_concentration`, and its estimate is run time / a rounded *up* to the next of `round_minutes` (so
  estimate >= run time), at most the last (the maximum, the machine's limit).
- A run longer than the maximum estimate is cut to it (the system would kill it there), so actual <= estimate for
  every job.

Seeds: the draws use numpy's stream for the entropy (seed, 95), so the same `seed` as the job generator's gives an
independent stream and the same arguments give the same workload. A seed pair (s, i) (the SFT builder's generated
episodes) gives the entropy (s, i, 95): never an integer seed's stream.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from frugaltune.scheduling.swf import Workload

ROUND_MINUTES = (1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 240, 300, 360, 480, 600, 720, 1080, 1440, 2160,
                 2880)
"""The round values users pick, in minutes (1 min .. 48 h); the last is the machine's maximum estimate."""

_STREAM = 95  # the second entropy word of this module's random stream (see the module docstring)


@dataclass(frozen=True)
class UserModel:
    """The users and estimates model's parameters (see the module docstring); `scheduling.*.users` in params."""

    users: int = 64
    zipf: float = 1.0
    groups: int = 8
    shape_spread: float = 0.5
    accuracy_a: float = 2.0
    accuracy_b: float = 3.0
    accuracy_concentration: float = 10.0
    max_estimate_share: float = 0.1
    round_minutes: tuple[int, ...] = ROUND_MINUTES

    def __post_init__(self) -> None:
        problems = []
        if self.users < 1 or self.groups < 1:
            problems.append(f"users={self.users} and groups={self.groups} must be >= 1")
        if self.zipf < 0 or self.shape_spread <= 0:
            problems.append(f"zipf={self.zipf} must be >= 0 and shape_spread={self.shape_spread} > 0")
        if min(self.accuracy_a, self.accuracy_b, self.accuracy_concentration) <= 0:
            problems.append("accuracy_a, accuracy_b and accuracy_concentration must be > 0")
        if not 0 <= self.max_estimate_share < 1:
            problems.append(f"max_estimate_share={self.max_estimate_share} must be in [0, 1)")
        rounds = list(self.round_minutes)
        if not rounds or rounds != sorted(set(rounds)) or rounds[0] <= 0:
            problems.append(f"round_minutes={rounds} must be increasing minutes > 0")
        if problems:
            raise ValueError("user model: " + "; ".join(problems) + ".")


def _assign_users(rng: np.random.Generator, runs: np.ndarray, sizes: np.ndarray, model: UserModel) -> np.ndarray:
    shape = np.column_stack([np.log1p(runs), np.log2(sizes)])
    scale = shape.std(axis=0)
    shape = shape / np.where(scale > 0, scale, 1.0)
    templates = shape[rng.integers(0, len(shape), model.users)]
    activity = np.arange(1, model.users + 1, dtype=float) ** -model.zipf
    distance2 = ((shape[:, None, :] - templates[None, :, :]) ** 2).sum(axis=2)
    # Subtracting each job's nearest distance keeps the exponent from underflowing for a job far from every template.
    weights = activity * np.exp(-(distance2 - distance2.min(axis=1, keepdims=True)) / (2 * model.shape_spread ** 2))
    cumulative = np.cumsum(weights, axis=1)
    draws = rng.random(len(runs)) * cumulative[:, -1]
    return (cumulative < draws[:, None]).sum(axis=1)


def _beta(rng: np.random.Generator, mean: np.ndarray, concentration: float) -> np.ndarray:
    mean = np.clip(mean, 1e-3, 1 - 1e-3)
    return rng.beta(mean * concentration, (1 - mean) * concentration)


def estimates(rng: np.random.Generator, runs: np.ndarray, users: np.ndarray, model: UserModel) -> np.ndarray:
    """Requested times (seconds) for jobs of run times `runs` (<= the maximum) submitted by `users` (0-based)."""
    mean_accuracy = rng.beta(model.accuracy_a, model.accuracy_b, model.users)
    max_propensity = _beta(rng, np.full(model.users, model.max_estimate_share), 2.0) \
        if model.max_estimate_share > 0 else np.zeros(model.users)
    rounds = np.array(model.round_minutes, dtype=float) * 60.0
    accuracy = _beta(rng, mean_accuracy[users], model.accuracy_concentration)
    wanted = np.maximum(runs, 1.0) / accuracy
    rounded = rounds[np.minimum(np.searchsorted(rounds, wanted, side="left"), len(rounds) - 1)]
    at_max = rng.random(len(runs)) < max_propensity[users]
    return np.where(at_max, rounds[-1], rounded)


def with_users(workload: Workload, model: UserModel = UserModel(), seed: int | tuple[int, ...] = 0) -> Workload:
    """`workload`'s jobs with users, groups and estimates drawn by `model` (see the module docstring); runs longer
    than the maximum estimate are cut to it. The source names the model's seed."""
    rng = np.random.default_rng([*(seed if isinstance(seed, tuple) else (seed,)), _STREAM])
    longest = model.round_minutes[-1] * 60
    runs = np.minimum(np.array([job.run_time for job in workload.jobs], dtype=float), longest)
    sizes = np.array([job.requested_procs for job in workload.jobs], dtype=float)
    users = _assign_users(rng, runs, sizes, model)
    requested = estimates(rng, runs, users, model)
    jobs = [dataclasses.replace(job, run_time=min(job.run_time, longest), requested_time=int(req), user_id=int(user) + 1,
                                group_id=int(user) % model.groups + 1)
            for job, run, req, user in zip(workload.jobs, runs, requested, users)]
    return dataclasses.replace(workload, jobs=jobs, source=f"{workload.source} + users(n={model.users}, "
                                                          f"seed={seed})")
