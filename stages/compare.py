"""Train and evaluate one method for the method comparison.  Run by DVC as:  python -m stages.compare <method>

The `compare@<method>` stages (a `matrix` in dvc.yaml) run every method of `compare.methods` on the same data,
seed and training budget (`compare.max_steps`), each with its own knobs (`train.<method>`), so changing one
method's params reruns only that method. Each writes `models/compare/<method>/` and
`reports/compare/<method>_{train,evaluate}.json`; `python -m stages.compare_table` gathers them.
"""

from __future__ import annotations

import sys

from frugaltune import allocator
from stages import evaluate, paths, train
from stages.config import ParamsError, load_params
from frugaltune.training.methods import METHODS


def run(params, method: str) -> dict:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; methods: {', '.join(METHODS)}")
    budget = {"method": method}
    if params.compare.max_steps:
        budget["max_steps"] = params.compare.max_steps
    params = params.model_copy(update={"train": params.train.model_copy(update=budget)})
    out = paths.compare_run(method)
    # Every method on the same batches as configured: the pipeline's plan (probe) is for train.method only.
    trained = train.run(params, out, use_plan=False)
    evaluated = evaluate.run(params, out)
    return {"train": trained, "evaluate": evaluated}


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(f"usage: python -m stages.compare <method>   (methods: {', '.join(METHODS)})")
    try:
        params = load_params()
        allocator.reexec_with(params.train.allocator)  # as in stages.train: before any tensor exists
        run(params, sys.argv[1])
    except (ParamsError, ValueError, FileNotFoundError) as exc:
        sys.exit(f"compare: {exc}")


if __name__ == "__main__":
    main()
