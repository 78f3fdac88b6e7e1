"""Params sections of the scheduling pipeline (scheduling/dvc.yaml; docs/SCHEDULING.md), read from
scheduling/params.yaml: `scheduling` and its parts, the default trace and where a trace is looked for.

Library code, no entry point: imported through `frugaltune.config`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from frugaltune.config.base import Section


# ----- the scheduling pipeline (scheduling/dvc.yaml; docs/SCHEDULING.md), read from scheduling/params.yaml ------


class SchedulingEvaluationParams(Section):
    sequence_length: int = Field(256, ge=1, description="Jobs per test sequence (RLScheduler's JOB_SEQUENCE_SIZE).")
    n_sequences: int = Field(20, ge=1, description="Test sequences, drawn at seeded points of the held-out part.")
    held_out_fraction: float = Field(
        0.3, gt=0, le=1, description="The last share of the trace (submit order) that only evaluation uses; SFT "
        "episodes come from the rest.")
    seed: int = Field(0, description="Seed of the test sequences' start points.")


class SchedulingSftParams(Section):
    episodes: int = Field(16, ge=1, description="Teacher episodes on the training part; each gives one SFT row "
                          "per decision with two or more visible jobs.")
    episode_length: int = Field(256, ge=2, description="Jobs per episode.")
    seed: int = Field(0, description="Seed of the episodes' start points.")
    rollout_policies: list[Literal["FCFS", "SJF", "WFP3", "UNICEF", "F1"]] = Field(
        ["F1"], min_length=1, description="Heuristics the lookahead teacher rolls each candidate out with (the "
        "lowest summed bsld over them counts); ties keep the first one's own choice.")
    horizon: int = Field(128, ge=0, description="Arrivals each rollout admits after the decision: longer sees "
                         "further and costs more (32 was worse than F1 alone on lublin_256, 128 beat it).")
    max_running: int = Field(4, ge=0, description="Running jobs listed in a prompt (soonest expected end first; "
                             "the rest counted): each costs ~5 tokens.")
    generated_episodes: int = Field(0, ge=0, description="Extra teacher episodes on Lublin-Feitelson workloads "
                                    "(frugaltune/scheduling/lublin.py) of episode_length jobs, from seed pairs "
                                    "(seed, i) no evaluation workload uses.")
    generated_procs: list[int] = Field([256], min_length=1, description="Machine sizes the generated episodes "
                                       "cycle through.")
    generated_loads: list[float] = Field([1.0], min_length=1, description="Offered loads the generated episodes "
                                         "cycle through (each size at each load in turn).")
    agree_share: float | None = Field(None, ge=0, le=1, description="At most this share of the SFT rows answers "
                                      "'A' (the order heuristic's pick, which the teacher makes at ~88% of "
                                      "decisions): the rest are sampled out, every departure kept; null keeps all.")

    @field_validator("generated_procs")
    @classmethod
    def _machine_sizes(cls, procs: list[int]) -> list[int]:
        if min(procs) < 2:
            raise ValueError(f"generated_procs {procs}: the model sizes jobs in log2 of the machine; give sizes >= 2.")
        return procs

    @field_validator("generated_loads")
    @classmethod
    def _loads(cls, loads: list[float]) -> list[float]:
        if min(loads) <= 0:
            raise ValueError(f"generated_loads {loads}: give offered loads > 0 (1.0 asks for the whole machine).")
        return loads


class SchedulingLlmParams(Section):
    fallback: Literal["FCFS", "SJF", "WFP3", "UNICEF", "F1"] = Field(
        "F1", description="Heuristic used, under a name that says so, when the fine-tuned model cannot be loaded.")
    batch_size: int = Field(20, ge=1, description="Prompts per forward: one per test sequence run in lockstep.")
    threads: int | None = Field(None, ge=1, description="torch threads for evaluation; null = the plan's, as the "
                                   "train stage ran (reports/train.json).")
    evaluate_base: bool = Field(True, description="Also judge the untuned base model (the study's comparison), in "
                                "the evaluate_base stage, which DVC keeps across retrains.")


class SchedulingUsersParams(Section):
    """Users and runtime estimates of a generated workload (frugaltune/scheduling/users.py)."""

    users: int = Field(64, ge=1, description="Users; user k submits with an activity proportional to k^-zipf.")
    zipf: float = Field(1.0, ge=0, description="Exponent of the users' Zipf-like activity (0: all alike).")
    groups: int = Field(8, ge=1, description="Groups; user u is in group u mod groups.")
    shape_spread: float = Field(0.5, gt=0, description="How far a user's jobs stray from the user's characteristic "
                                "job, in standard deviations of (ln run time, log2 processors).")
    accuracy_a: float = Field(2.0, gt=0, description="Users' mean accuracy (run time / estimate) ~ Beta(a, b).")
    accuracy_b: float = Field(3.0, gt=0, description="See accuracy_a.")
    accuracy_concentration: float = Field(10.0, gt=0, description="A job's accuracy ~ Beta around its user's mean "
                                          "with this concentration (higher: a more consistent user).")
    max_estimate_share: float = Field(0.1, ge=0, lt=1, description="Mean share of jobs asking for the maximum "
                                      "estimate (the last round value), per user ~ Beta with this mean.")
    round_minutes: list[int] = Field(  # users.ROUND_MINUTES (this module imports no scheduling code)
        [1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 240, 300, 360, 480, 600, 720, 1080, 1440, 2160, 2880],
        min_length=1, description="The round values estimates "
                                     "are rounded up to, increasing minutes; the last is the maximum.")

    @field_validator("round_minutes")
    @classmethod
    def _increasing(cls, minutes: list[int]) -> list[int]:
        if minutes[0] <= 0 or minutes != sorted(set(minutes)):
            raise ValueError(f"round_minutes {minutes}: give increasing minutes > 0 (the last is the maximum).")
        return minutes


def _second_users() -> SchedulingUsersParams:
    return SchedulingUsersParams(users=32, zipf=1.3, shape_spread=0.7, accuracy_a=1.0, accuracy_b=2.0,
                                 max_estimate_share=0.2)


class SchedulingUserWorkloadParams(Section):
    procs: int = Field(256, ge=2, description="Machine size of the estimate-and-user workload.")
    jobs: int = Field(10000, ge=1, description="Jobs generated by the Lublin-Feitelson model "
                      "(frugaltune/scheduling/lublin.py), then given users and estimates (users.py).")
    load: float | None = Field(None, gt=0, description="Offered load the arrivals are scaled to; null = the model's "
                               "own for this machine size.")
    seed: int = Field(2001, description="Generator seed (jobs, then users and estimates).")
    users: SchedulingUsersParams = Field(default_factory=SchedulingUsersParams)


class SchedulingSecondWorkloadParams(Section):
    procs: int = Field(128, ge=2, description="Machine size of the second evaluation workload (another size than "
                       "the trace's).")
    jobs: int = Field(5000, ge=1, description="Jobs generated by the Lublin-Feitelson model "
                      "(frugaltune/scheduling/lublin.py).")
    load: float | None = Field(0.9, gt=0, description="Offered load the arrivals are scaled to; null = the model's "
                               "own for this machine size.")
    seed: int = Field(1001, description="Generator seed: one that no training workload uses, so the policies are "
                      "judged on a workload nobody tuned on.")
    n_sequences: int = Field(10, ge=1, description="Test sequences, drawn anywhere in it (none of it is trained on).")
    sequence_length: int = Field(256, ge=1, description="Jobs per test sequence.")
    users: SchedulingUsersParams = Field(default_factory=_second_users, description="Its users and estimates: "
                                         "other parameters than the estimate-and-user workload's.")


class SchedulingValidateParams(Section):
    min_jobs: int = Field(1000, ge=1, description="Table-level: fewer parsed jobs than this fail the stage.")
    max_overshoot_fraction: float = Field(
        0.5, ge=0, le=1, description="Table-level: share of jobs running longer than they requested, at most.")


# The default trace, kept in the repository (scheduling/data/README.md: source, model, sha256), relative to
# scheduling/. ingest_trace refuses it when its bytes differ from these (an edit, a Git LFS pointer, converted line
# endings), as every result in docs/SCHEDULING.md was measured on exactly them.
DEFAULT_TRACE = "data/lublin_256.swf"
DEFAULT_TRACE_SHA256 = "a394ab3d81179ebcf645a1cbd593a60b6dff7f11a510e1e6285c45f43310c962"


def trace_file(trace: str, base_dir: Path) -> Path:
    """`scheduling.trace` as the scheduling stages open it: relative to `base_dir`, the params file's directory
    (scheduling/, their working directory under DVC). Raises FileNotFoundError naming the path and the fix."""
    path = Path(base_dir) / trace
    if not path.is_file():
        raise FileNotFoundError(
            f"no such file: {path.resolve()} (a relative path starts in {Path(base_dir).resolve()}, the params "
            f"file's directory). Point it at an SWF trace (gunzip archive downloads first), or back at the "
            f"default {DEFAULT_TRACE!r}, the repository's copy (scheduling/data/README.md).")
    return path


class SchedulingParams(Section):
    trace: str = Field(DEFAULT_TRACE, description="SWF trace, relative to the scheduling pipeline's directory "
                       "(scheduling/), as published by the Parallel Workloads Archive; the default is in the "
                       "repository (scheduling/data/README.md).")
    max_procs: int | None = Field(None, ge=1, description="Machine size; null = the trace's MaxProcs or MaxNodes.")
    window: int = Field(8, ge=1, le=26, description="Waiting jobs every policy sees (oldest first), lettered A..Z "
                        "in prompts; the heuristics are judged at the same window.")
    order: Literal["queue", "FCFS", "SJF", "WFP3", "UNICEF", "F1"] = Field(
        "F1", description="The order in which a prompt letters the visible jobs: queue (arrival) order, or best "
        "first by a heuristic's score, so that 'A' is that heuristic's choice and the model learns where the "
        "teacher departs from it. The same order in the SFT rows and in the LLM policy.")
    backfill: bool = Field(False, description="EASY backfilling in the SFT episodes and in the mode whose "
                           "numbers gate the registry (`finetuned.avg_bsld`); every policy is judged in both modes.")
    evaluation: SchedulingEvaluationParams = Field(default_factory=SchedulingEvaluationParams)
    sft: SchedulingSftParams = Field(default_factory=SchedulingSftParams)
    llm: SchedulingLlmParams = Field(default_factory=SchedulingLlmParams)
    user_workload: SchedulingUserWorkloadParams = Field(default_factory=SchedulingUserWorkloadParams)
    second_workload: SchedulingSecondWorkloadParams = Field(default_factory=SchedulingSecondWorkloadParams)
    validate_: SchedulingValidateParams = Field(default_factory=SchedulingValidateParams, alias="validate")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("trace")
    @classmethod
    def _trace_exists(cls, trace: str, info: ValidationInfo) -> str:
        # Only a params file says where relative paths start (load_params passes its directory); params built in
        # memory (tests, flows) name no file, so there is nothing to look at.
        base_dir = (info.context or {}).get("params_dir")
        if base_dir is not None:
            try:
                trace_file(trace, base_dir)
            except FileNotFoundError as exc:
                raise PydanticCustomError("trace_not_found", "{why}", {"why": str(exc).rstrip(".")}) from None
        return trace
