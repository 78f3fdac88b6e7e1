"""From `scheduling.*` params to the library's objects: the trace, the evaluation protocol, the SFT config, the
teacher, the generated workloads and the workloads the LLMs are judged on.

Library code, imported by the scheduling pipeline's stages (`python -m stages.<name>` in scheduling/) so that each
fact (which window, which sequences) is turned into objects in one place.
"""

from __future__ import annotations

from pathlib import Path

from frugaltune.config import SchedulingParams, SchedulingUsersParams
from frugaltune.scheduling.evaluation import Protocol
from frugaltune.scheduling.lublin import at_load, lublin_workload
from frugaltune.scheduling.policies import HEURISTICS
from frugaltune.scheduling.sft import LookaheadTeacher, SftConfig
from frugaltune.scheduling.swf import Workload, read_swf
from frugaltune.scheduling.users import UserModel, with_users


def load_workload(path: str | Path, sp: SchedulingParams) -> Workload:
    """The trace at `path`, machine size from `scheduling.max_procs` when set."""
    return read_swf(path, max_procs=sp.max_procs) if sp.max_procs else read_swf(path)


def protocol(sp: SchedulingParams) -> Protocol:
    ev = sp.evaluation
    return Protocol(sequence_length=ev.sequence_length, n_sequences=ev.n_sequences,
                    held_out_fraction=ev.held_out_fraction, seed=ev.seed, window=sp.window)


def sft_config(sp: SchedulingParams) -> SftConfig:
    s = sp.sft
    return SftConfig(protocol=protocol(sp), episodes=s.episodes, episode_length=s.episode_length, seed=s.seed,
                     rollout_policies=tuple(s.rollout_policies), horizon=s.horizon, backfill=sp.backfill,
                     max_running=s.max_running, order=sp.order, generated_episodes=s.generated_episodes,
                     generated_procs=tuple(s.generated_procs), generated_loads=tuple(s.generated_loads),
                     users=user_model(sp.user_workload.users), agree_share=s.agree_share)


def teacher(sp: SchedulingParams) -> LookaheadTeacher:
    """The lookahead teacher build_sft labels with, for the ceiling and the departure check."""
    return LookaheadTeacher([HEURISTICS[name] for name in sp.sft.rollout_policies], sp.sft.horizon)


def user_model(users: SchedulingUsersParams) -> UserModel:
    return UserModel(**{**users.model_dump(), "round_minutes": tuple(users.round_minutes)})


def _generate(procs: int, jobs: int, load: float | None, seed: int, users: SchedulingUsersParams) -> Workload:
    workload = lublin_workload(jobs, procs, seed)
    workload = at_load(workload, load) if load is not None else workload
    return with_users(workload, user_model(users), seed)


def generate_user_workload(sp: SchedulingParams) -> Workload:
    """`scheduling.user_workload`: the Lublin-Feitelson model for its machine size and seed, at its load, with
    users and their runtime estimates (users.py)."""
    uw = sp.user_workload
    return _generate(uw.procs, uw.jobs, uw.load, uw.seed, uw.users)


def generate_second_workload(sp: SchedulingParams) -> Workload:
    """`scheduling.second_workload`: the same, for its own machine size, seed, load and users' parameters."""
    sw = sp.second_workload
    return _generate(sw.procs, sw.jobs, sw.load, sw.seed, sw.users)


def evaluation_workloads(sp: SchedulingParams, user_workload: str | Path, second_workload: str | Path,
                         trace: str | Path) -> dict[str, tuple[Workload, Protocol]]:
    """What evaluate_base and evaluate_policy judge the LLMs on, by the names their reports use, in table order:
    the estimate-and-user workload's held-out sequences (`scheduling.evaluation`), the second workload's (never
    trained on) and the trace's (on the Lublin model's, requested time = run time: the oracle case)."""
    return {"user_workload": (read_swf(user_workload), protocol(sp)),
            "second_workload": (read_swf(second_workload), second_protocol(sp)),
            "trace": (load_workload(trace, sp), protocol(sp))}


def second_protocol(sp: SchedulingParams) -> Protocol:
    """Test sequences of the second workload: drawn anywhere in it (held_out_fraction 1: none of it is trained
    on), with the evaluation seed and the same window."""
    sw = sp.second_workload
    return Protocol(sequence_length=sw.sequence_length, n_sequences=sw.n_sequences, held_out_fraction=1.0,
                    seed=sp.evaluation.seed, window=sp.window)
