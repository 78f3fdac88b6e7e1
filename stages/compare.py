"""Train and evaluate one method for the method comparison.  Run by DVC as:  python -m stages.compare <method>

The `compare@<method>` stages (a `matrix` in dvc.yaml) run every method of `compare.methods` on the same data,
seed and training budget (`compare.max_steps`), each with its own knobs (`train.<method>`), so changing one
method's params reruns only that method. Each writes `models/compare/<method>/` and
`reports/compare/<method>_{train,evaluate}.json`; `python -m stages.compare_table` gathers them.
"""

from __future__ import annotations

if __name__ == "__main__":
    # Before the heavy imports below: a malloc cannot change after start, so this process may re-execute itself
    # on mimalloc (train.allocator), and doing it here saves importing torch, datasets and mlflow twice.
    from frugaltune import allocator as _allocator

    _allocator.reexec_early()

import sys

from frugaltune.faults import stage_errors
from frugaltune import paths, store
from frugaltune.recipes import evaluate, train
from frugaltune.config import ParamsError, load_params
from frugaltune.methods import NAMES, get as method_named


def run(params, method: str) -> dict:
    method_named(method)  # an unknown name: ValueError naming the methods
    budget = {"method": method}
    if params.compare.max_steps:
        budget["max_steps"] = params.compare.max_steps
    params = params.model_copy(update={"train": params.train.model_copy(update=budget)})
    out = paths.compare_run(method)
    # Every method on the same batches as configured: the pipeline's plan is for train.method only.
    trained = train.run(params, out, use_plan=False)
    evaluated = evaluate.run(params, out)
    return {"train": trained, "evaluate": evaluated}


def main() -> None:
    with stage_errors("compare"):  # a full disk: one clear line, not a traceback
        if len(sys.argv) != 2:
            sys.exit(f"usage: python -m stages.compare <method>   (methods: {', '.join(NAMES)})")
        try:
            run(load_params(), sys.argv[1])  # on train.allocator's malloc already: see the first lines
        except (ParamsError, ValueError, FileNotFoundError, store.StoreError) as exc:  # a server that is down too
            sys.exit(f"compare: {exc}")


if __name__ == "__main__":
    main()
