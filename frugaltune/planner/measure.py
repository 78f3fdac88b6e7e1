"""What the calibration's process runs: the train stage's own loop over the run's micro-batches, timed step by step.

Library code, run only inside the calibration's worker process (`python -m frugaltune.planner --calibration-worker`,
started by frugaltune.planner.worker.CalibrationWorker): it reads its spec on stdin, reports each step on stdout as
a JSON line, and ends with what it measured. Per step: seconds, peak RSS, compiled graphs; the bytes autograd saves
for backward; the other methods timed in turn with the calibrated one. The time line both sides fit lives here too.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from frugaltune import methods
from frugaltune.planner.memory import MethodKnobs


class _SavedBytes:
    """The bytes autograd saves for backward in one training step: each storage once, the model's parameters and
    buffers left out (a frozen weight kept for the input's gradient is not activation memory), a parameter's copy
    in another dtype (bf16 autocast's weight casts: a fixed cost, not per token) counted apart in `casts`.
    `last_step_of(n)` counts only the last of a train_classifier call's n steps, the hooks pushed from its on_log
    between two steps, so that the steps timed before it run without them."""

    def __init__(self, model):
        import torch

        parameters = [*model.parameters(), *model.buffers()]
        self.excluded = {t.untyped_storage().data_ptr() for t in parameters}
        self.floating = [t for t in parameters if t.is_floating_point() and t.numel() >= self.FIRST]
        self.weights: dict = {}  # per dtype: each parameter's (bytes, first values) cast to it
        self.storages: dict[int, int] = {}
        self.casts: dict[int, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda packed: packed)
        self.steps, self.pushed = 0, False

    FIRST = 8  # values compared: an activation with a weight's size and first 8 values is not met

    def _is_cast(self, tensor, storage) -> bool:
        """Whether `storage` holds a parameter's copy in `tensor`'s dtype: its size and first values are one's."""
        import torch

        dtype = tensor.dtype
        if not tensor.is_floating_point() or storage.nbytes() < self.FIRST * tensor.element_size():
            return False
        if dtype not in self.weights:
            self.weights[dtype] = {(t.numel() * tensor.element_size(),
                                    tuple(t.detach().reshape(-1)[:self.FIRST].to(dtype).tolist()))
                                   for t in self.floating if t.dtype != dtype}
        first = torch.empty(0, dtype=dtype).set_(storage, 0, (self.FIRST,), (1,))
        return (storage.nbytes(), tuple(first.tolist())) in self.weights[dtype]

    def _pack(self, tensor):
        try:
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
            if pointer and pointer not in self.excluded and pointer not in self.storages and pointer not in self.casts:
                (self.casts if self._is_cast(tensor, storage) else self.storages)[pointer] = storage.nbytes()
        except NotImplementedError:  # a sparse tensor has no storage to count
            pass
        return tensor.detach()  # not the tensor itself: a saved output would hold its own grad_fn in a cycle

    def last_step_of(self, steps: int):
        def on_log(_record: dict) -> None:
            self.steps += 1
            if self.steps == steps - 1:
                self.hooks.__enter__()
                self.pushed = True
        return on_log

    def total(self) -> int:
        """The bytes saved but for the weight casts (the hooks popped, if `last_step_of` pushed them)."""
        if self.pushed:
            self.hooks.__exit__(None, None, None)
            self.pushed = False
        return sum(self.storages.values())

    def cast_total(self) -> int:
        return sum(self.casts.values())


def _calibration_point(spec: dict) -> dict:
    """Run in a fresh process (a clean peak RSS): the train stage's own loop (frugaltune.training.loop, the plan's
    LoopConfig and int8 decision) over the run's own micro-batches that `spec` names; per step its seconds and the
    peak RSS so far."""
    import resource

    began = time.perf_counter()
    import psutil
    import torch
    from torch._dynamo.utils import counters

    from frugaltune import allocator, faults
    from frugaltune.training.loop import train_classifier
    from frugaltune.training.loop_config import LoopConfig
    from frugaltune.training.methods import prepare_model
    from frugaltune.training.setup import apply_int8

    torch.set_num_threads(spec["threads"])
    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # noqa: E731
    data = json.loads(Path(spec["rows_file"]).read_text())
    rows, targets, batches = data["rows"], data["targets"], data["batches"][:spec.get("batches") or None]
    def build(which: dict = spec):
        return prepare_model(spec["model_dir"], spec["labels"], spec["pad_token_id"], spec["seed"],
                             methods.get(which["method"]),
                             MethodKnobs(**{k: tuple(v) if isinstance(v, list) else v
                                            for k, v in which["knobs"].items()}),
                             spec["loop"]["bf16"], spec["gradient_checkpointing"], task=spec["task"])

    model = build()
    # the model as loaded: what the process holds now, not its high-water mark (converting weights, to bf16 or
    # 4 bit, briefly holds both copies)
    loaded_rss = psutil.Process().memory_info().rss
    phases = {"build_s": time.perf_counter() - began}
    int8 = apply_int8(model, spec["int8"], methods.get(spec["method"]))
    # What the planner keeps of a calibration it stops early (CalibrationWorker.run): this line, then one per step
    _report({"built": {"loaded_rss_bytes": loaded_rss, "int8_products": bool(int8["on"]),
                       "allocator": allocator.active(), "build_s": round(phases["build_s"], 2)}})
    # the run's LoopConfig back from its serialized form (LoopConfig.to_dict), over the steps `batches` names: one
    # micro-batch a step, each logged, no checkpoints, no warm-up
    cfg = LoopConfig.build(**{**spec["loop"], "checkpoint_dir": None, "resume": False, "max_steps": None,
                              "grad_accum": 1, "log_every": 1, "warmup_ratio": 0.0})
    # Graphs inductor compiles afresh here (not found in its on-disk cache) are found there by every later process
    # on this machine, the run's among them: counted per step so that the plan can tell a cold start from a warm one.
    compiled = lambda: counters["inductor"].get("fxgraph_cache_miss", 0)  # noqa: E731
    marks: list[tuple[float, int, int, float, float]] = []
    # with other methods to compare: what this one saves for backward in its last step (their rows, see calibrate)
    saved = _SavedBytes(model) if spec.get("others") and not spec.get("batches") else None
    count = saved.last_step_of(len(batches)) if saved else lambda record: None

    def on_log(record: dict) -> None:
        marks.append((record["elapsed_s"], peak(), compiled(), time.process_time(), time.perf_counter()))
        count(record)
        elapsed, rss, graphs, cpu, wall = marks[-1]
        _report({"mark": [elapsed, rss, graphs, cpu - cpu_start, wall - wall_start]})
        faults.inject("calibration", f"step-{len(marks)}")

    cpu_start, wall_start = time.process_time(), time.perf_counter()
    optimizer_state: dict = {}  # AdamW's, kept for the steps taken in turn with the other methods'
    try:
        train_classifier(model, rows, targets, cfg, spec["pad_token_id"], progress=False, batches=batches,
                         on_log=on_log, optimizer_state=optimizer_state)
    finally:  # the hooks off before anything else runs in this process (the other methods' steps)
        saved_bytes = saved.total() if saved else None
        cast_bytes = saved.cast_total() if saved else None
    busy = _cpu_share(marks, cpu_start, wall_start, spec["threads"])
    phases["steps_s"] = time.perf_counter() - wall_start
    inference = []
    if data.get("inference") and not spec.get("batches"):  # forward passes, as evaluation runs them
        from frugaltune.classify import classify

        # evaluation runs the plain model (int8 products are training's): a model as loaded, when they were on
        evaluated = build() if int8["on"] else model
        for batch in data["inference"]["batches"]:  # each batch: its rows' token ids
            begin = time.perf_counter()
            classify(evaluated, batch, spec["pad_token_id"], batch_size=len(batch), bf16=spec["loop"]["bf16"])
            inference.append(time.perf_counter() - begin)
    steps = _marked_steps(marks)
    others = {}
    if spec.get("others") and not spec.get("batches"):
        evaluated = None  # noqa: F841 (the model stays: its steps on the others' rows are taken in turn with theirs)
        # the ETA as calibrate will make it: the line under the peak over the run's steps, and the start-up (what
        # the first pass paid beyond that line)
        timed = [(float(t), s["seconds"]) for t, s in zip(spec["runs_tokens"], steps)]
        overhead, per_token, excess = _step_line(timed[:spec["first_pass"]], timed[spec["first_pass"]:])
        budget = None
        if spec.get("others_share") is not None:  # the calibration as a whole may cost this share of the run
            run_s = sum(excess) + spec["run_steps"] * overhead + spec["run_tokens"] * per_token
            budget = spec["others_share"] * run_s - (time.time() - spec["sent_at"])  # since the planner's wait began
        mark = time.perf_counter()
        others = _time_other_methods(spec, build, rows, targets, cfg, overhead + per_token * spec["others_tokens"],
                                     budget, calibrated=(model, optimizer_state))
        model = None
        phases["others_s"] = time.perf_counter() - mark
    phases["total_s"] = time.perf_counter() - began
    phases = {k: round(v, 2) for k, v in phases.items()}
    return {"phases": phases, "loaded_rss_bytes": loaded_rss, "steps": steps, "int8_products": bool(int8["on"]),
            "cpu_share": round(busy, 3), "allocator": allocator.active(), "inference_seconds": inference,
            "others": others, "saved_bytes": saved_bytes, "cast_bytes": cast_bytes}


def _report(line: dict) -> None:
    """One line of the calibration's progress to the planner, as it happens (the worker's stdout is its pipe)."""
    print(json.dumps(line), flush=True)


def _marked_steps(marks: list) -> list[dict]:
    """The loop's cumulative marks (elapsed, peak RSS, compiled graphs, ...) -> each step's own seconds and graphs."""
    steps, previous = [], (0.0, 0)
    for elapsed, rss, graphs, *_ in marks:
        steps.append({"seconds": elapsed - previous[0], "peak_rss_bytes": rss, "compiled_graphs": graphs - previous[1]})
        previous = (elapsed, graphs)
    return steps


def _cpu_share(marks: list[tuple], cpu_start: float, wall_start: float, threads: int) -> float:
    """The share of `threads` cores this process kept busy over the calibration's steps (marks: per step its
    cumulative (elapsed, peak, compiled graphs, process time, wall clock)), counting only the steps that compiled
    nothing: inductor compiles in worker processes whose CPU this process's clock does not see, so a cold first
    step would read as a busy machine on an idle one. All steps when every one compiled."""
    spans, previous = [], (cpu_start, wall_start, 0)
    for _, _, graphs, cpu, wall in marks:
        spans.append((cpu - previous[0], wall - previous[1], graphs - previous[2]))
        previous = (cpu, wall, graphs)
    warm = [(cpu, wall) for cpu, wall, compiled in spans if compiled == 0] or [(c, w) for c, w, _ in spans]
    return sum(c for c, _ in warm) / max(sum(w for _, w in warm) * threads, 1e-9)


def _time_other_methods(spec: dict, build, rows: list, targets: list, cfg, step_s: float,
                        budget_s: float | None, calibrated: tuple) -> dict:
    """Each method in `spec["others"]`, in that order, built as its training builds it (its knobs, its int8
    decision) and timed on rows of one of the run's micro-batches (`spec["others_batch"]`, about `step_s` seconds a
    step for the calibrated method), its steps taken in turn with those of the `calibrated` (model, optimizer
    state from the calibration's loop) on the same rows: its cost is the ratio of the two, measured seconds apart.
    A method that cannot be built for this task is reported with its error, not timed; one that the calibration's
    budget (`budget_s` seconds left, None: no bound) cannot pay for, as much as the dearest method timed so far
    (before the first: six steps), is reported skipped."""
    import contextlib
    import gc

    from frugaltune.training.loop import train_classifier
    from frugaltune.training.setup import apply_int8

    timed: dict[str, dict] = {}
    batch = spec["others_batch"]
    costs: list[float] = []  # what each method timed so far cost, its build included

    def step(model, rows_of_step: list[int], optimizer_state: dict) -> float:
        """One step of the train stage's loop: a call of its own, whose optimizer starts from (and leaves) the
        model's state, so that the step is a steady one (AdamW's state made once, outside the step's time)."""
        seconds: list[float] = []
        train_classifier(model, rows, targets, cfg, spec["pad_token_id"], progress=False, batches=[rows_of_step],
                         optimizer_state=optimizer_state, on_log=lambda record: seconds.append(record["elapsed_s"]))
        return seconds[0]

    # Each method's warm-up step runs two of the rows: it allocates the method's gradients and optimizer state and
    # touches its kernels at a fraction of a full step's price. Then the rows twice, the faster kept: one step
    # alone read the machine's noise, and a new model's first step into pages the process does not have yet can
    # take twice its second. The calibrated method's steps alternate with the method's (A B A B): on a shared
    # machine whose speed drifts over seconds, a reference timed half a minute earlier read the drift, not the
    # method. In this thread, as the run's steps are: the two loops in threads of their own, taking turns, ran
    # their steps slower than here (docs/DECISIONS.md, "Each method its own ETA", "A method's cost timed in turn
    # with the calibrated one's").
    calibrated, calibrated_state = calibrated
    for other in spec["others"]:
        began = time.perf_counter()
        # what this method may cost, before it is built: as much as the dearest timed so far (a bound, not a guess:
        # the mean let the calibration overrun its share), before the first six of the calibrated method's steps
        expected = max(costs) if costs else 6 * step_s
        if budget_s is not None and budget_s < expected:
            timed[other["method"]] = {"skipped": f"the calibration's budget ({spec['others_share']:.0%} of the run) "
                                                 "is spent"}
            continue
        try:
            model = build({"method": other["method"], "knobs": other["knobs"]})
            apply_int8(model, other["int8"], methods.get(other["method"]))
            state: dict = {}
            step(model, batch[:2], state)
            steps_s, calibrated_s = [], []
            saved = _SavedBytes(model)
            for last in (False, True):
                calibrated_s.append(round(step(calibrated, batch, calibrated_state), 4))
                with saved.hooks if last else contextlib.nullcontext():  # what it saves for backward: its last step
                    steps_s.append(round(step(model, batch, state), 4))
            timed[other["method"]] = {"seconds": min(steps_s), "steps_s": steps_s, "saved_bytes": saved.total(),
                                      "cast_bytes": saved.cast_total(),
                                      "calibrated_seconds": min(calibrated_s), "calibrated_steps_s": calibrated_s,
                                      "total_s": round(time.perf_counter() - began, 2)}
            costs.append(time.perf_counter() - began)
        except Exception as error:  # noqa: BLE001 -- e.g. a method this task does not support: no figure for it
            timed[other["method"]] = {"error": f"{type(error).__name__}: {error}"[:300]}
        model = state = None
        gc.collect()
        if budget_s is not None:
            budget_s -= time.perf_counter() - began
    return timed


def _worker_main() -> None:
    """`python -m frugaltune.planner --calibration-worker`: import first, then wait for the spec on stdin."""
    began = time.perf_counter()
    from frugaltune import processes

    processes.die_with_parent(processes.parent_from_env())  # a killed plan stage leaves no calibration running
    import torch  # noqa: F401 -- what the steps need, imported before the spec arrives

    from frugaltune.training import loop, methods, setup  # noqa: F401
    imported = time.perf_counter()
    spec = json.loads(sys.stdin.read())
    point = _calibration_point(spec)
    # imports_s: paid before the spec arrived, beside the planner's own work; waited_s: how long the worker then
    # waited for it (0: the planner waited for the imports instead)
    point["phases"].update(imports_s=round(imported - began, 2), waited_s=round(time.perf_counter() - imported
                                                                               - point["phases"]["total_s"], 2))
    print(json.dumps(point))



def _fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares `seconds = overhead + per_token x tokens`; (overhead, per_token), both >= 0."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if n < 2 or var == 0:
        return 0.0, mean_y / mean_x
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var
    if slope <= 0:  # noise swamped the size effect: the whole step per token
        return 0.0, mean_y / mean_x
    overhead = mean_y - slope * mean_x
    if overhead < 0:  # a line through the origin instead
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    return overhead, slope


def _step_line(first_pass: list[tuple[float, float]], again: list[tuple[float, float]]
               ) -> tuple[float, float, list[float]]:
    """The calibration's time line from its (padded tokens, seconds) steps: `step = overhead + per_token x tokens`
    fitted under the peak (`again`; the first pass after its warm-up step when there is none), and what each
    first-pass step paid beyond it (its warm-up, its growth into new pages). Shared by `calibrate` and its worker,
    which budgets the other methods against the same ETA."""
    overhead, per_token = _fit_line(again or first_pass[1:])
    return overhead, per_token, [max(0.0, s - overhead - per_token * t) for t, s in first_pass]
