"""Scheduling decisions as prompt -> response pairs: the text encoding, a lookahead teacher, the SFT data builder.

Library code: `build_sft(workload, SftConfig())` -> (rows, report); the `build_sft` stage of the scheduling pipeline
(`python -m stages.build_sft`, run by `dvc repro scheduling/dvc.yaml`) writes the rows as JSONL with
prompt/response/candidates columns, which the causal_lm task trains on like any pairs file.

The encoding (`encode_state`): one short text per decision, about 200 SmolLM2 tokens at window 8 (plus the chat
template's ~25). Times are in whole minutes (a 7-digit second count costs 7 tokens and tells the model nothing a
minute count does not; SmolLM2 spends a token per digit), the visible waiting jobs get letters A, B, C... (one
token each), their fields are separated by spaces only (", " costs two tokens a field), and the answer is a letter:

    Pick the job to run next. Answer with its letter.
    machine 256 procs, 64 free, 37 waiting, time 20:34
    running (min left x procs): 3x32 40x64 120x8 200x16 +5 more
    waiting (letter procs requested_min waited_min predicted_min user_accuracy):
    A 16 60 2 12 2
    B 1 1 0 1 -

Per waiting job, beside what it asks for and how long it waited, what a real scheduler knows of its user at that
moment (`SchedulerState.history`, the user's *finished* jobs; never the job's own run time): Tsafrir's prediction
(`state.predicted_time`: the mean of the user's last two run times, capped by the estimate; the estimate without
history) and the user's accuracy, the median actual/requested time of those finished jobs in tenths, one digit
(0: under 10% of the estimate used, 9: 90% or more), "-" for a user with no finished job yet. So job A above asks
for 60 min, its user's last two jobs ran about 12 min, and that user's jobs use about a fifth of what they ask.

The teacher (`LookaheadTeacher`): at each decision it tries every visible job as the choice, rolls the simulation
forward with each rollout heuristic (admitting only the next `horizon` arrivals, so every rollout schedules the
same jobs), and keeps the job whose best rollout has the lowest summed bounded slowdown. Rollouts run jobs for
their actual run times: the teacher is clairvoyant about the near future, which the student, who sees only the
estimates and its users' finished jobs, is not; that gap is the point of a teacher. Ties keep the first rollout
heuristic's own choice, so the teacher never differs from that heuristic without a measured reason.

Episodes come from the training part of the workload given (before `evaluation.held_out_start`; the pipeline gives
the estimate-and-user workload, `data/user_workload.swf`), so the held-out sequences the policies are judged on are
never seen in training, and, when `generated_episodes` asks for them, from the Lublin-Feitelson model (`lublin.py`)
for other machine sizes and offered loads, with users and their estimates (`users.py`, `SftConfig.users`), each
from a seed pair (`seed`, episode) that no evaluation workload uses (the evaluation workloads' seeds are single
integers). Each episode starts with no user history, as each test sequence does.

The teacher agrees with F1, whose pick the prompts letter "A", at ~88% of decisions on lublin_256; a student fed
that share learns to answer "A" (it did: the same bsld as F1 on every held-out sequence). `agree_share` samples
the agreeing rows down (seeded) so they are at most that share of the rows; every departure is kept.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from frugaltune.scheduling.evaluation import Protocol, held_out_start
from frugaltune.scheduling.lublin import at_load, lublin_workload
from frugaltune.scheduling.metrics import BSLD_TAU, sequence_metrics
from frugaltune.scheduling.policies import BASELINES, HEURISTICS, ScorePolicy
from frugaltune.scheduling.simulator import JobView, SchedulerState, SimulationResult, Simulator, simulate
from frugaltune.scheduling.state import Finished
from frugaltune.scheduling.swf import Job, Workload
from frugaltune.scheduling.users import UserModel, with_users

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
MAX_WINDOW = len(LETTERS)
"""The most visible jobs a prompt can letter (A..Z)."""

INSTRUCTION = "Pick the job to run next. Answer with its letter."


def job_labels(n: int) -> list[str]:
    """The answers for a window of `n` visible jobs: "A", "B", ... in queue order."""
    if not 1 <= n <= MAX_WINDOW:
        raise ValueError(f"a window of {n} jobs: prompts letter at most {MAX_WINDOW} (A..Z); use 1 <= window <= "
                         f"{MAX_WINDOW}.")
    return list(LETTERS[:n])


def listed(state: SchedulerState, order: str = "queue") -> list[JobView]:
    """The visible jobs in the order a prompt letters them (A first): queue (arrival) order, or best first by the
    score of the heuristic named `order` (its ties as in ScorePolicy), so that "A" is that heuristic's choice."""
    if order == "queue":
        return list(state.queue)
    if order not in HEURISTICS:
        raise ValueError(f"scheduling.order = {order!r}: use 'queue' or a heuristic ({', '.join(HEURISTICS)}).")
    score, clock = HEURISTICS[order].score, state.clock
    return sorted(state.queue, key=lambda job: (score(job, clock), job.submit_time, job.job_id))


def _minutes_up(seconds: float) -> int:
    return int(math.ceil(max(seconds, 0.0) / 60.0))


def user_accuracy(history: Sequence[Finished]) -> str:
    """The prompt's accuracy figure of a user's finished jobs: the median actual/requested time in tenths, one digit
    (9: 0.9 or more), "-" without history (see the module docstring)."""
    if not history:
        return "-"
    return str(min(int(float(np.median([f.accuracy for f in history])) * 10.0), 9))


def encode_state(state: SchedulerState, max_running: int = 4, order: str = "queue") -> str:
    """The prompt for one decision (see the module docstring). At most `max_running` running jobs are listed,
    soonest expected end first (the rest counted), so a full machine does not double the prompt. The clock is the
    time of day (the trace's clock modulo 24 h): what a real trace's daily cycle depends on, the same however a
    sequence was cut, and 5 characters instead of a growing second count. The visible jobs are lettered in
    `order` (see `listed`), each with its user's prediction and accuracy (from finished jobs only)."""
    running = state.running
    shown = " ".join(f"{_minutes_up(r.expected_end - state.clock)}x{r.job.requested_procs}"
                     for r in running[:max_running])
    if len(running) > max_running:
        shown += f" +{len(running) - max_running} more"
    lines = [
        INSTRUCTION,
        f"machine {state.total_procs} procs, {state.free_procs} free, {state.queue_length} waiting, "
        f"time {int(state.clock % 86400 // 3600):02d}:{int(state.clock % 3600 // 60):02d}",
        f"running (min left x procs): {shown or 'none'}",
        "waiting (letter procs requested_min waited_min predicted_min user_accuracy):",
    ]
    for label, job in zip(job_labels(len(state.queue)), listed(state, order)):
        lines.append(f"{label} {job.requested_procs} {_minutes_up(job.requested_time)} "
                     f"{int(state.wait_time(job) // 60)} {_minutes_up(state.predicted_time(job))} "
                     f"{user_accuracy(state.history(job))}")
    return "\n".join(lines)


def rollout_cost(sim: Simulator, first: JobView, policy: ScorePolicy, horizon: int, tau: float = BSLD_TAU,
                 future: Sequence[Job] | None = None) -> float:
    """Summed bounded slowdown of the jobs a rollout schedules: `first` committed now, then `policy`, admitting
    `horizon` more arrivals, or the jobs of `future` instead of the true ones (`Simulator.clone`). Jobs that
    started before the decision add the same amount to every candidate."""
    trial = sim.clone(future_arrivals=horizon) if future is None else sim.clone(future=future)
    trial.commit(first, "rollout")
    trial.run_to_end(policy)
    n = trial.arrival_limit
    start = trial.start[:n]
    submit = np.fromiter((j.submit_time for j in trial.arrivals[:n]), float, n)
    run = trial.ran[:n]  # the teacher's privilege: actual run times (a backfilled job's up to its kill)
    return float(np.maximum((start - submit + run) / np.maximum(run, tau), 1.0).sum())


@dataclass
class LookaheadTeacher:
    """Chooses by rolling every visible job forward with each rollout heuristic (see the module docstring)."""

    rollout_policies: Sequence[ScorePolicy]
    horizon: int = 128
    """Arrivals admitted after the decision in each rollout."""
    rollouts: int = field(default=0, init=False)
    """Rollouts run so far (for the cost report)."""

    def __post_init__(self) -> None:
        if not self.rollout_policies:
            raise ValueError("LookaheadTeacher needs at least one rollout heuristic (e.g. SJF).")
        if self.horizon < 0:
            raise ValueError(f"horizon={self.horizon}: give a number of future arrivals >= 0.")

    @property
    def name(self) -> str:
        return f"lookahead({'/'.join(p.name for p in self.rollout_policies)}, h={self.horizon})"

    def choose(self, sim: Simulator, state: SchedulerState) -> JobView:
        default = self.rollout_policies[0].choose(state)
        if len(state.queue) == 1:
            return default
        # The default first: a candidate replaces it only when strictly better, then in queue order.
        order = [default] + [job for job in state.queue if job is not default]
        best, best_cost = default, math.inf
        for job in order:
            cost = min(rollout_cost(sim, job, policy, self.horizon) for policy in self.rollout_policies)
            self.rollouts += len(self.rollout_policies)
            if cost < best_cost:
                best, best_cost = job, cost
        return best


def teacher_episode(jobs: Sequence[Job], total_procs: int, teacher: LookaheadTeacher, window: int,
                    backfill: bool = False, max_running: int = 4,
                    order: str = "queue") -> tuple[SimulationResult, list[dict]]:
    """Simulate `jobs` with the teacher choosing; every decision with two or more visible jobs becomes a row
    {prompt, response, candidates}. One-candidate decisions are not rows: the LLM policy answers them without
    the model."""
    sim = Simulator(jobs, total_procs, backfill=backfill, window=window)
    rows = []
    while (state := sim.next_decision()) is not None:
        choice = teacher.choose(sim, state)
        if len(state.queue) > 1:
            labels = job_labels(len(state.queue))
            position = next(i for i, job in enumerate(listed(state, order)) if job is choice)
            rows.append({"prompt": encode_state(state, max_running, order), "response": labels[position],
                         "candidates": labels})
        sim.commit(choice, teacher.name)
    return sim.result(teacher.name), rows


@dataclass(frozen=True)
class SftConfig:
    """What `build_sft` builds; the scheduling pipeline fills it from `scheduling.sft` in params.yaml."""

    protocol: Protocol = Protocol(window=8)
    """The evaluation protocol: its held-out part is excluded, its window is the prompts' window (8 keeps a
    prompt near 150 SmolLM2 tokens; the heuristics are judged at the same window)."""
    episodes: int = 16
    episode_length: int = 256
    seed: int = 0
    rollout_policies: tuple[str, ...] = ("F1",)
    """Measured on lublin_256 (window 8, 6 training episodes): F1 rollouts at horizon 128 gave avg bsld 254 vs
    F1's 280, not worse on any episode; adding SJF rollouts changed nothing at twice the cost; horizon 32 was
    worse than F1 itself (a short rollout ends on an emptying queue and underprices delaying wide jobs)."""
    horizon: int = 128
    backfill: bool = False
    max_running: int = 4
    order: str = "queue"
    """How prompts letter the visible jobs (`listed`); the pipeline's default is F1 (scheduling.order)."""
    generated_episodes: int = 0
    """Extra teacher episodes on Lublin-Feitelson workloads of `episode_length` jobs (module docstring)."""
    users: UserModel = UserModel()
    """The users and estimates of the generated episodes (the pipeline's: `scheduling.user_workload.users`)."""
    generated_procs: tuple[int, ...] = (256,)
    """Machine sizes the generated episodes cycle through."""
    generated_loads: tuple[float, ...] = (1.0,)
    """Offered loads the generated episodes cycle through (after the sizes: episode i has size i % len(procs) and
    load (i // len(procs)) % len(loads))."""
    agree_share: float | None = None
    """At most this share of the rows answers the order's first job (the others are sampled out); None keeps all."""


def episode_starts(workload: Workload, cfg: SftConfig) -> np.ndarray:
    """Seeded start indices of the training episodes, each `episode_length` jobs inside the training part."""
    room = held_out_start(workload, cfg.protocol) - cfg.episode_length
    if room < 0:
        raise ValueError(f"{workload.source}: the training part has {held_out_start(workload, cfg.protocol)} jobs, "
                         f"fewer than scheduling.sft.episode_length={cfg.episode_length}. Shorten the episodes or "
                         f"lower scheduling.evaluation.held_out_fraction.")
    return np.random.default_rng(cfg.seed).integers(0, room + 1, size=cfg.episodes)


def generated_episodes(cfg: SftConfig) -> list[Workload]:
    """The `generated_episodes` workloads: episode i is `episode_length` Lublin-Feitelson jobs for its machine size,
    from the seed pair (cfg.seed, i), scaled to its offered load, with users and estimates (`cfg.users`) from the
    same seed pair."""
    episodes = []
    for i in range(cfg.generated_episodes):
        procs = cfg.generated_procs[i % len(cfg.generated_procs)]
        load = cfg.generated_loads[(i // len(cfg.generated_procs)) % len(cfg.generated_loads)]
        jobs = at_load(lublin_workload(cfg.episode_length, procs, seed=[cfg.seed, i]), load)
        episodes.append(with_users(jobs, cfg.users, seed=(cfg.seed, i)))
    return episodes


def _fewer_agreeing(rows: list[dict], share: float, seed: int) -> list[dict]:
    """`rows` with those answering "A" sampled down to at most `share` of the result (seeded; order kept)."""
    agree = [i for i, row in enumerate(rows) if row["response"] == LETTERS[0]]
    depart = len(rows) - len(agree)
    keep = len(agree) if share >= 1 else min(len(agree), int(share * depart / (1 - share)))
    kept = set(np.random.default_rng(seed).choice(agree, size=keep, replace=False).tolist()) if keep else set()
    return [row for i, row in enumerate(rows) if row["response"] != LETTERS[0] or i in kept]


def build_sft(workload: Workload, cfg: SftConfig) -> tuple[list[dict], dict]:
    """Teacher episodes on the training part of `workload` (and generated ones) -> (SFT rows, report). The report
    compares the teacher's average bounded slowdown with every baseline's (the heuristics, SJF and F1 on
    predictions) on the very same episodes, per source ("workload", "generated"): a student can only beat the
    baselines if its teacher does."""
    unknown = [name for name in cfg.rollout_policies if name not in HEURISTICS]
    if unknown:
        raise ValueError(f"scheduling.sft.rollout_policies: {unknown} are not heuristics; choose from "
                         f"{', '.join(HEURISTICS)}.")
    if not 1 <= cfg.protocol.window <= MAX_WINDOW:
        raise ValueError(f"scheduling.window = {cfg.protocol.window}: prompts letter the visible jobs A..Z, so "
                         f"the window must be 1..{MAX_WINDOW}.")
    if cfg.agree_share is not None and not 0 <= cfg.agree_share <= 1:
        raise ValueError(f"scheduling.sft.agree_share = {cfg.agree_share}: give a share in [0, 1], or null to "
                         "keep every row.")
    teacher = LookaheadTeacher([HEURISTICS[n] for n in cfg.rollout_policies], cfg.horizon)
    episodes = [("workload", workload.max_procs, workload.jobs[start:start + cfg.episode_length])
                for start in episode_starts(workload, cfg)]
    episodes += [("generated", w.max_procs, w.jobs) for w in generated_episodes(cfg)]
    rows: list[dict] = []
    bsld: dict[str, dict[str, list[float]]] = {}
    decisions = 0
    for number, (source, procs, jobs) in enumerate(episodes):
        result, episode_rows = teacher_episode(jobs, procs, teacher, cfg.protocol.window, cfg.backfill,
                                               cfg.max_running, cfg.order)
        for row in episode_rows:
            row["episode"] = number
        rows.extend(episode_rows)
        decisions += result.decisions
        per = bsld.setdefault(source, {"teacher": [], **{name: [] for name in BASELINES}})
        per["teacher"].append(sequence_metrics(result).avg_bsld)
        for name, policy in BASELINES.items():
            heuristic = simulate(jobs, procs, policy, backfill=cfg.backfill, window=cfg.protocol.window)
            per[name].append(sequence_metrics(heuristic).avg_bsld)
    departures = sum(row["response"] != LETTERS[0] for row in rows)
    labelled = len(rows)
    if cfg.agree_share is not None:
        rows = _fewer_agreeing(rows, cfg.agree_share, cfg.seed)
    means = {source: {name: float(np.mean(values)) for name, values in per.items()} for source, per in bsld.items()}
    main = means.get("workload", next(iter(means.values())))
    wins = {name: int(sum(t <= h for t, h in zip(bsld["workload"]["teacher"], bsld["workload"][name])))
            for name in BASELINES} if "workload" in bsld else {}
    report = {
        "teacher": teacher.name,
        "episodes": cfg.episodes,
        "generated_episodes": cfg.generated_episodes,
        "decisions": decisions,
        "labelled_rows": labelled,
        "departures": departures,
        "departure_share": departures / labelled if labelled else 0.0,
        "rows": len(rows),
        "rows_departure_share": sum(row["response"] != LETTERS[0] for row in rows) / len(rows) if rows else 0.0,
        "rollouts": teacher.rollouts,
        "avg_bsld": main,
        "avg_bsld_by_source": means,
        "teacher_not_worse_episodes": wins,
        "teacher_beats_best_heuristic": bool(main["teacher"] < min(main[n] for n in BASELINES)),
    }
    return rows, report
