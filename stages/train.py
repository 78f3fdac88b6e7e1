"""Fine-tune the base model (a sequence classifier, or its own LM head on prompt -> response pairs with
`task.type: causal_lm`).  Run by DVC as:  python -m stages.train

Reads `train.*`, `common.seed`, `data/tokenized/`, the label set, `models/base/` and `reports/plan.json` (the `plan`
stage's resolved run: precision, micro-batch, gradient checkpointing, threads). With `train.input_template` each
classification row is wrapped in it (frugaltune/input_template.py), and labels.json records it for evaluation and
serving.
Writes `models/adapter/` (PEFT adapter in safetensors + tokenizer + labels.json), `reports/train.json` (loss,
useful tokens/s, wall time, peak RSS, trainable parameters, the resolved precision and threads) and the loss curve
`reports/plots/train_loss.csv`. Each run is one MLflow run with params, step metrics and these artifacts.

With `train.distributed.nproc_per_node: N` > 1 the stage re-launches itself under `torchrun --standalone` with N
ranks (data parallel, frugaltune.training.distributed); launched by torchrun directly (several hosts, see README
"Scaling out") it joins the group torchrun describes. Only rank 0 talks to MLflow and writes the outputs.

Checkpoints go to `checkpoints/train/<key>/` (outside the stage's outs, which `dvc repro` deletes first) every
`train.checkpoint_every` steps and on SIGINT/SIGTERM; with `train.resume: auto` an interrupted run (kill -9
included) continues from the newest complete checkpoint of the same configuration when `dvc repro` runs again.
"""

from __future__ import annotations

if __name__ == "__main__":
    # Before the heavy imports below: a malloc cannot change after start, so this process may re-execute itself
    # on mimalloc (train.allocator), and doing it here saves importing torch, datasets and mlflow twice.
    from frugaltune import allocator as _allocator, processes as _processes

    _processes.die_with_parent()  # before seconds of imports: killed DVC, no training (stage_errors repeats it)
    _allocator.reexec_early()

import os
import sys

from frugaltune import paths, store
from frugaltune.planner.assembly import PlanError
from frugaltune.config import ParamsError, load_params
from frugaltune.faults import stage_errors
from frugaltune.recipes.train import run
from frugaltune.training import checkpoint, distributed
from frugaltune.training.loop import DivergenceError
from frugaltune.training.oom import OutOfMemoryAtBatchOne
from frugaltune.training.signals import TrainingInterrupted

__all__ = ["main", "run"]


def main() -> None:
    """The stage's entry point (a process of its own: it may re-execute itself on another malloc)."""
    with stage_errors("train"):  # a full disk: one clear line, not a traceback
        try:
            params = load_params()
            nproc = params.train.distributed.nproc_per_node
            if nproc > 1 and not distributed.launched_by_torchrun():
                # One process per rank, on this host; torchrun stops all of them if one fails
                argv = distributed.torchrun_argv(nproc, "stages.train")
                print(f"train: {nproc} ranks: {' '.join(argv[1:])}", flush=True)
                os.execv(argv[0], argv)
            run(params)  # on train.allocator's malloc already: see the first lines of this module
        except TrainingInterrupted as exc:
            sys.exit(interrupted_message(exc))
        except (ParamsError, PlanError, DivergenceError, OutOfMemoryAtBatchOne, ValueError,
                FileNotFoundError, checkpoint.CheckpointRefused, store.StoreError) as exc:
            sys.exit(f"train: {exc}")


def interrupted_message(exc: TrainingInterrupted) -> str:
    """The loop's message and the command that continues the run: the loop cannot know which pipeline runs it,
    the stage knows (its working directory's dvc.yaml: `dvc repro scheduling/dvc.yaml` for the scheduling one)."""
    return f"train: {exc} From the project root: `{paths.repro_command()}`."


if __name__ == "__main__":
    main()
