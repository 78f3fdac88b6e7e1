"""Hand-written parts vs the maintained library that does the same job, measured in one run (issue #13, item 9).

Run from the project root after `make pipeline` (needs data/tokenized):  python benchmarks/handwritten_vs_library.py

1. Length-grouped batching (`frugaltune.training.batching.length_grouped_batches`) vs transformers'
   `LengthGroupedSampler` (what `group_by_length=True` uses), same lengths, batch size and seeds: the share of
   padding tokens in the batches (the work a step wastes), and whether every batch is a contiguous chunk of the
   order the resume logic can recompute from (seed, position).
2. Telemetry: frugaltune's `TelemetrySampler` vs MLflow's `SystemMetricsMonitor` (`mlflow.enable_system_metrics_logging`)
   sampling for the same time at the same 1 s interval while the main thread trains-like (a matmul loop): the
   samplers' own CPU time, and what each records.
3. OOM back-off vs accelerate's `find_executable_batch_size`: features only (no CUDA device here to run out of).

Prints ratios and writes reports/benchmarks/handwritten_vs_library.json.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import tempfile
import threading
import time
from pathlib import Path

import torch

from frugaltune import paths
from frugaltune.training.batching import length_grouped_batches

OUT = Path("reports/benchmarks/handwritten_vs_library.json")
BATCH = 16
SEEDS = range(5)


def padding_share(batches: list[list[int]], lengths: list[int]) -> float:
    real = sum(lengths[i] for batch in batches for i in batch)
    padded = sum(max(lengths[i] for i in batch) * len(batch) for batch in batches)
    return 1 - real / padded


def batching() -> dict:
    from datasets import load_from_disk
    from transformers.trainer_pt_utils import LengthGroupedSampler

    lengths = [len(ids) for ids in load_from_disk(str(paths.TOKENIZED_DIR))["train"]["input_ids"]]
    ours, hf, random_ = [], [], []
    for seed in SEEDS:
        generator = torch.Generator().manual_seed(seed)
        ours.append(padding_share(length_grouped_batches(lengths, BATCH, generator, True), lengths))
        generator = torch.Generator().manual_seed(seed)
        order = list(LengthGroupedSampler(BATCH, lengths=lengths, generator=generator))
        hf.append(padding_share([order[i:i + BATCH] for i in range(0, len(order), BATCH)], lengths))
        generator = torch.Generator().manual_seed(seed)
        shuffled = torch.randperm(len(lengths), generator=generator).tolist()
        random_.append(padding_share([shuffled[i:i + BATCH] for i in range(0, len(shuffled), BATCH)], lengths))
    mean = lambda xs: round(sum(xs) / len(xs), 4)  # noqa: E731
    result = {"rows": len(lengths), "batch_size": BATCH, "seeds": len(SEEDS), "padding_share_frugaltune": mean(ours),
              "padding_share_hf_length_grouped_sampler": mean(hf), "padding_share_random": mean(random_)}
    print(f"batching: padding share, {len(lengths)} rows, batch {BATCH}, {len(SEEDS)} seeds: frugaltune "
          f"{result['padding_share_frugaltune']:.2%}, HF LengthGroupedSampler "
          f"{result['padding_share_hf_length_grouped_sampler']:.2%}, shuffled {result['padding_share_random']:.2%}")
    return result


def _busy(stop: threading.Event) -> None:
    a = torch.randn(512, 512)
    while not stop.is_set():
        a = torch.tanh(a @ a)


def _thread_cpu_s(native_id: int) -> float:
    """CPU seconds (user + system) of one thread of this process, from /proc (Linux): the same measure for both."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def telemetry(seconds: float = 30.0) -> dict:
    import mlflow
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    from frugaltune.telemetry import TelemetrySampler

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        mlflow.set_tracking_uri(f"sqlite:///{tmp}/mlflow.db")
        mlflow.set_experiment("bench")
        for name in ("frugaltune", "mlflow"):
            stop = threading.Event()
            worker = threading.Thread(target=_busy, args=(stop,), name="busy")
            with mlflow.start_run() as run:
                cpu0 = time.process_time()
                worker.start()
                if name == "frugaltune":
                    sampler = TelemetrySampler(1.0, Path(tmp) / "t.csv", run.info.run_id, cores=2)
                    with sampler:
                        time.sleep(seconds)
                        own = _thread_cpu_s(sampler._thread.native_id)
                    summary = sampler.summary()
                    recorded = sorted(k for k, v in summary.items() if isinstance(v, int | float))
                else:
                    monitor = SystemMetricsMonitor(run.info.run_id, sampling_interval=1, samples_before_logging=1)
                    monitor.start()
                    time.sleep(seconds)
                    own = _thread_cpu_s(monitor._process.native_id)
                    monitor.finish()
                    recorded = sorted(mlflow.MlflowClient().get_run(run.info.run_id).data.metrics)
                stop.set()
                worker.join()
            results[name] = {"sampler_cpu_s": round(own, 3), "cpu_percent_of_run": round(100 * own / seconds, 3),
                             "process_cpu_s": round(time.process_time() - cpu0, 1), "recorded": recorded}
            print(f"telemetry: {name}: sampler CPU {own:.3f} s in {seconds:.0f} s "
                  f"({100 * own / seconds:.3f}% of one core); records {len(recorded)} series")
    return results


OOM = {
    "frugaltune": "halves the micro-batch inside the running step and doubles gradient accumulation, so the "
                  "effective batch, the optimizer state and the position in the epoch are kept; the run goes on "
                  "from the same step and reports the event; fails with OutOfMemoryAtBatchOne at micro-batch 1",
    "accelerate.find_executable_batch_size": "re-calls the whole training function with half the batch size: "
                  "the user's function must rebuild model, optimizer and data loader and the effective batch "
                  "changes unless the caller compensates; progress made before the OOM is lost",
    "cpu_note": "on a CPU, running out of RAM is the kernel's OOM killer (SIGKILL), not an exception either can "
                "catch: the planner's memory fit and checkpoints/resume are what protect a CPU run",
}


def main() -> None:
    report = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
              "threads": torch.get_num_threads()}
    try:
        report["cpu_model"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    report["batching"] = batching()
    report["telemetry"] = telemetry()
    report["oom"] = OOM
    ours, hf = report["batching"]["padding_share_frugaltune"], report["batching"]["padding_share_hf_length_grouped_sampler"]
    print(f"ratio: HF sampler padding / frugaltune padding = {hf / ours:.2f}x" if ours else "ratio: no padding")
    t = report["telemetry"]
    print(f"ratio: MLflow monitor CPU / frugaltune sampler CPU = "
          f"{t['mlflow']['sampler_cpu_s'] / max(t['frugaltune']['sampler_cpu_s'], 1e-9):.2f}x")
    report["max_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
