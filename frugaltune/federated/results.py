"""What a finished federation leaves for its report: the rounds summarized (metrics, bytes on the wire, adapter vs
full model), each client's measured time and memory beside its plan, the final adapter exported as a served PEFT
dir, and CSV text for the plots.

Library code, used by the federated stage; never run.
"""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

from frugaltune import methods, paths
from frugaltune.config import Params
from frugaltune.federated import local, rounds
from frugaltune.io import write_json


def summarize(out: Path, model_dir: Path) -> tuple[dict, list[dict]]:
    """(the run's summary, one row per completed round: its evaluation, the bytes sent so far, clients completed)."""
    reports = rounds.reports(out)
    last = rounds.round_path(out, rounds.last_completed_round(out), "safetensors")
    adapter_bytes = sum(t.numel() * t.element_size() for t in load_file(str(last)).values())
    full_bytes = sum(t.numel() * t.element_size() for f in model_dir.glob("*.safetensors")
                     for t in load_file(str(f)).values())
    found, sent = [], 0
    for report in reports:
        clients = report.get("clients", [])
        sent += sum(c["bytes-up"] + c["bytes-down"] for c in clients)
        found.append({"round": report["round"], **report["evaluation"], "bytes_total": sent,
                      "clients_completed": report.get("completed", 0),
                      # rounds before the last may be evaluated on a sample of the split (round_eval_rows)
                      "evaluation_rows": report.get("evaluation_rows", "")})
    ups = [c["bytes-up"] for r in reports for c in r.get("clients", [])]
    downs = [c["bytes-down"] for r in reports for c in r.get("clients", [])]
    summary = {"final": reports[-1]["evaluation"], "baseline": reports[0]["evaluation"],
               # a run stopped before its last round ends on a round evaluated on the sample (round_eval_rows)
               "final_evaluation_rows": found[-1]["evaluation_rows"],
               "rounds": len(reports) - 1, "bytes_up_per_client_round_max": max(ups, default=0),
               "bytes_down_per_client_round": max(downs, default=0), "bytes_total": sent,
               "adapter_bytes": adapter_bytes, "full_model_bytes": full_bytes,
               "full_model_over_adapter": round(full_bytes / adapter_bytes, 1),
               "failures": sum(len(r.get("failures", [])) for r in reports)}
    return summary, found


def client_rows(name: str, out: Path, plans: list[dict]) -> list[dict]:
    """Per client of run `name`: its plan's predicted peak memory and time beside what it measured, over the rounds
    it completed (peak RSS: the largest; seconds: the mean)."""
    done: dict[int, list[dict]] = {}
    for report in rounds.reports(out):
        for client in report.get("clients", []):
            if "client-id" in client:
                done.setdefault(int(client["client-id"]), []).append(client)
    found = []
    for plan in plans:
        mine = done.get(plan["client"], [])
        if not plan["fits"] or not mine:
            continue
        found.append({"run": name, "client": plan["client"], "preset": plan["preset"], "rounds": len(mine),
                      "peak_rss_mb": max(c["peak-rss-mb"] for c in mine),
                      "predicted_peak_mb": plan.get("predicted_peak_mb"),
                      "seconds": round(sum(c["seconds"] for c in mine) / len(mine), 3),
                      "predicted_seconds": plan.get("predicted_seconds"),
                      "predicted_seconds_here": plan.get("predicted_seconds_here")})
    return found


def export_adapter(out: Path, params: Params, labels: list[str], pad_token_id: int, dest: Path,
                   template: str | None = None) -> None:
    """The run's last global adapter + head as a PEFT dir with the tokenizer and labels.json: what serving loads
    (frugaltune/serving/), the same layout the train stage writes to models/adapter/. labels.json records the input
    `template` the clients trained with, from where serving wraps its inputs."""
    from frugaltune.io import atomic_dir
    from frugaltune.models import load_tokenizer
    from frugaltune.training.methods import save_trained

    fp = params.federated
    number = rounds.last_completed_round(out)  # a round exists when its JSON does, not the folder's last file
    last = rounds.round_path(out, number, "safetensors")
    spec = fp.lora.knobs()
    model = local.build_model(paths.BASE_MODEL, labels, pad_token_id, params.common.seed, spec)
    local.load_tensors(model, load_file(str(last)))
    with atomic_dir(dest) as tmp:
        save_trained(model, methods.get("lora"), tmp)
        load_tokenizer(paths.BASE_MODEL).save_pretrained(tmp)
        manifest = {"labels": labels, "max_length": params.tokenize.max_length, "method": "lora",
                    "federated": {"run": dest.name, "round": number}}
        write_json(tmp / "labels.json", manifest | ({"input_template": template} if template else {}))


def print_summary(report: dict) -> None:
    """The federated stage's closing lines: each run's final figures, the reference's, the budget against the
    measured time."""
    for name, summary in report["runs"].items():
        final = summary["final"]
        print(f"federated: {name}: {summary['rounds']} rounds, test macro-F1 {final['macro_f1']:.4f} accuracy "
              f"{final['accuracy']:.4f} (base {summary['baseline']['macro_f1']:.4f}); "
              f"{summary['bytes_up_per_client_round_max']:,} bytes up "
              f"per client per round, full model / adapter {summary['full_model_over_adapter']}x"
              + (f"; {summary['macro_f1_gap_to_centralized']:+.4f} macro-F1 below centralized"
                 if "macro_f1_gap_to_centralized" in summary else ""))
    if "centralized" in report:
        central = report["centralized"]
        print(f"federated: centralized LoRA, {central['examples']} examples ({central['steps']} steps of "
              f"{central['batch_size']}): test macro-F1 {central['final']['macro_f1']:.4f} accuracy "
              f"{central['final']['accuracy']:.4f}")
    print(f"federated: budget: {report['budget']['trade']}; measured {report['wall_seconds'] / 60:.1f} min")
    for later in report["budget"].get("later", []):  # the federations after the first, if the machine slowed
        if later["cut"]:
            print(f"federated: budget: {later['trade']}")
    print(f"federated: {report['wall_seconds']:.0f} s in all; each run "
          + ", ".join(f"{name} {summary['wall_seconds']:.0f} s" for name, summary in report["runs"].items()))
