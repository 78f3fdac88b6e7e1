"""What several benchmarks share: the pipeline's data and model as a benchmark loads them, the plan's machine
decisions, timing and A/B alternation, child processes and result files.

Not a benchmark: the benchmarks run as `python benchmarks/<name>.py` from the repository root, so this file's
folder is the first entry of their import path and they `import common` (`python benchmarks/common.py` only says
what it is; `make bench` does not run it). Everything here uses the installed `frugaltune`; nothing here decides a
setting the plan decides (precision, int8 products, the attention crossover, threads): `machine` reads the plan's
decisions through frugaltune.resolve, which decides nothing (no plan for this machine: `dvc repro plan`).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from frugaltune import paths

ROOT = Path(__file__).resolve().parents[1]
BASE = paths.BASE_MODEL
TOKENIZED = paths.TOKENIZED_DIR
LABELS_FILE = paths.LABELS
RESULTS = paths.REPORTS / "benchmarks"


# --- the pipeline's outputs --------------------------------------------------------------------------------------

def require(*needed: Path, fix: str = "run `make pipeline` first") -> None:
    """Exit with one line naming the first missing input and how to make it."""
    for path in needed:
        if not Path(path).exists():
            sys.exit(f"{path} is missing: {fix}.")


def labels() -> list[str]:
    return json.loads(LABELS_FILE.read_text())["labels"]


def training_examples(count: int) -> tuple[list[list[int]], list[int]]:
    """`count` rows of the training split as the train stage feeds them: a seeded sample across the split, each row
    wrapped in `train.input_template` (frugaltune.training.setup.training_rows, as the train stage wraps it).

    Not the split's first rows: it is stored grouped by label (the first 640 were all one class, ~2 tokens shorter
    than the split's mean), and bare rows are ~4 tokens shorter than the pipeline's templated ones."""
    import random

    from datasets import load_from_disk

    from frugaltune.config import load_params
    from frugaltune.models import load_tokenizer
    from frugaltune.training.setup import training_rows

    train = load_from_disk(str(TOKENIZED))["train"]
    if count > len(train):
        raise SystemExit(f"{TOKENIZED}: the training split has {len(train)} rows and this run needs {count} "
                         "((--warmup + --steps) x --batch-size, x rounds for an alternated A/B): ask for fewer")
    train = train.select(sorted(random.Random(42).sample(range(len(train)), count)))
    ids = training_rows(load_params(), [list(row) for row in train["input_ids"]], load_tokenizer(BASE))
    return [list(row) for row in ids], list(train["labels"])


def lora_model(bf16: bool, method: str = "lora", switches: bool = True, knobs=None, model_dir: Path = BASE):
    """(model, tokenizer): `method` on the base model (or `model_dir`'s, the project's tokenizer either way) with a
    seeded head, as `prepare_model` builds it for training. `switches=False`: peft's own dropout modules and fp32
    frozen weights, as before frugaltune.training.fast."""
    import torch

    from frugaltune import methods
    from frugaltune.models import load_tokenizer
    from frugaltune.planner.memory import MethodKnobs
    from frugaltune.training.methods import prepare_model

    tokenizer = load_tokenizer(BASE)
    model = prepare_model(model_dir, labels(), tokenizer.pad_token_id, 42, methods.get(method), knobs or MethodKnobs(),
                          bf16)
    if not switches:
        from frugaltune.training.fast import frozen_weights_in

        frozen_weights_in(model, torch.float32)  # autocast casts them at every use again
        replace_lora_dropouts(model, lambda: torch.nn.Dropout(MethodKnobs().dropout),
                              lambda dropout: hasattr(dropout, "shared"))
    return model, tokenizer


def replace_lora_dropouts(model, make, which=lambda dropout: True) -> None:
    """Put `make()` in place of each of peft's LoRA dropout modules in `model` for which `which(module)` holds."""
    import torch

    for module in model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if isinstance(dropouts, torch.nn.ModuleDict):
            for name, dropout in list(dropouts.items()):
                if which(dropout):
                    dropouts[name] = make()


def model_dir(given: str | None, cache: Path = Path(".cache/shapes")) -> Path:
    """The model a benchmark trains: models/base (None), a model directory with weights, or a shape's name or
    config (frugaltune/assets/shapes) whose random weights are written once into `cache/<name>/random-weights` and
    kept there for the next run (time and memory do not depend on the weights' values)."""
    if given is None:
        return BASE
    from frugaltune import shapes
    from frugaltune.models import load_tokenizer

    model = shapes.resolve(given, cache / Path(given).name, "float32")
    if model.by_shape:
        shapes.check_vocabulary(model, len(load_tokenizer(BASE)), BASE)
    return model.weights_dir()


# --- the plan's decisions ----------------------------------------------------------------------------------------

def machine(method: str = "lora", int8: bool = False) -> dict:
    """The plan's machine decisions on this machine (frugaltune.resolve.machine: bf16, precision_why,
    eager_attention_max_len, threads, int8) for params.yaml's `train.precision`, read from reports/plan.json; no
    plan for this machine and these params: one line saying to run `dvc repro plan`. `int8`: also
    `train.int8_products`' decision for `method`."""
    from frugaltune import resolve
    from frugaltune.config import load_params
    from frugaltune.planner.assembly import PlanError

    tp = load_params().train
    try:
        return resolve.machine(tp.precision, method, tp.int8_products if int8 else None)
    except PlanError as exc:
        raise SystemExit(f"{Path(sys.argv[0]).name}: {exc}") from None


def forced_int8(on: bool) -> dict:
    """An int8 decision an A/B compares (frugaltune.int8.apply carries it out), not one the plan made."""
    return {"on": on, "why": "A/B variant"}


def cpu_label(hw: dict) -> str:
    """The CPU a figure came from, as a report names it: the probe's model (the name with its family and model
    numbers, which tell Zen 3 from Zen 4 where a VM names both "AMD EPYC": frugaltune.hardware.parse_cpuinfo),
    cores and the flags that decide precision."""
    cpu = hw["cpu"]
    flags = [name for name, on in cpu.get("flags", {}).items() if on] or ["no avx2"]
    return f"{cpu['model']}, {cpu.get('physical_cores', '?')} cores, {'+'.join(flags)}"


# --- timing ------------------------------------------------------------------------------------------------------

def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Seconds per call after a warm-up of a tenth of the calls."""
    for _ in range(max(3, repeats // 10)):
        fn()
    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - began) / repeats


def alternated(names: list[str], rounds: int, measure: Callable[[int, str], float]) -> dict[str, list[float]]:
    """`measure(number, name)` for each name in each of `rounds` rounds, alternating which goes first (the given
    order in even rounds); round 0 warms every variant up and is not kept. Returns each name's kept values.
    Alternation within one process, not runs minutes apart, is what makes a few percent visible."""
    kept: dict[str, list[float]] = {name: [] for name in names}
    for number in range(rounds):
        for name in names if number % 2 == 0 else list(reversed(names)):
            value = measure(number, name)
            if number:
                kept[name].append(value)
    return kept


def loop_round(model, ids: list, labels: list, cfg, pad_token_id: int, number: int, name: str) -> float:
    """One round of an alternated A/B: the project's loop on these rows; prints and returns useful tokens/s."""
    from frugaltune.training.loop import train_classifier

    result = train_classifier(model, ids, labels, cfg, pad_token_id, progress=False)
    rate = result.tokens / result.wall_seconds
    print(f"  round {number}{' (warm-up)' if not number else ''}: {name}: {rate:.1f} useful tok/s "
          f"({result.wall_seconds:.1f} s)", flush=True)
    return rate


def peak_memory() -> dict:
    """This process's peak RSS (and a CUDA device's peak allocation when there is one), in MB."""
    import torch

    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if torch.cuda.is_available():
        out["cuda_peak_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


# --- child processes and results ---------------------------------------------------------------------------------

def run_child(cmd: list[str], what: str, env: dict[str, str] | None = None, **kwargs) -> dict:
    """Run a benchmark's child process (its own peak RSS, its own malloc) and return the JSON of its last line of
    stdout; exit with the end of its stderr when it fails."""
    env = {**(os.environ if env is None else env), "TQDM_DISABLE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, **kwargs)
    if proc.returncode != 0:
        sys.exit(f"{what} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def scratch_project(root: Path, linked: tuple[str, ...] = (), copied: tuple[str, ...] = ()) -> Path:
    """`root` made a project root for whole stages (`python -m stages.<name>`, cwd=root, env=stage_env()) that must
    not write into this checkout: `linked` paths as symlinks to this checkout's (what the stages only read),
    `copied` as copies (what they rewrite); paths that do not exist here are left out."""
    for relative in linked + copied:
        source, target = ROOT / relative, root / relative
        if not source.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if relative in linked:
            target.symlink_to(source, target_is_directory=source.is_dir())
        else:
            (shutil.copytree if source.is_dir() else shutil.copy)(source, target)
    return root


def stage_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment (`base`, default this process's) of a stage run from a scratch project: PYTHONPATH is this
    checkout (its `stages` package is not installed), progress bars off, and `extra`."""
    return {**(os.environ if base is None else base), "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1", **extra}


def write_results(name: str, data: dict) -> Path:
    """reports/benchmarks/<name>.json; prints where it went."""
    out = RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    print("benchmarks/common.py: the benchmarks' shared setup (imported as `common`), not a benchmark itself.")
