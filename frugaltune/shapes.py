"""Models by shape, before their weights: what `frugaltune plan --model NAME|CONFIG|DIR` plans.

Library code, called by the `frugaltune plan` command (frugaltune/cli.py); tests call it on tiny configs.

A model's training time and memory depend on its shape (hidden size, layers, heads, KV heads, intermediate size,
vocabulary, tied embeddings), not on its weights' values. `assets/shapes/*.json` hold the public `config.json`
facts of the models people fine-tune on small machines, each naming its source (`_source`): the plan builds its
analytic draft from them on the meta device, and its calibration runs the pipeline's own loop on a model of
exactly that shape with random weights (`PlannedModel.weights_dir`), written as the `import_model` stage writes a
model (safetensors, `model.dtype`), so that loading, QLoRA's NF4 quantization and int8 products take the path a
real checkpoint takes. A directory whose weights are present is planned with those weights.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

SHAPES_DIR = Path(__file__).parent / "assets" / "shapes"
# what makes a directory a checkpoint rather than a config: transformers loads any of these
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
# the keys that decide time and memory; a config without one cannot be planned
REQUIRED = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "vocab_size")
SHARD_BYTES = 2 * 2**30
GiB = 2**30


class ShapeError(ValueError):
    """`--model` cannot be planned; the message names the input, what is wrong and what to give instead."""


def names() -> list[str]:
    """The models whose shapes the repository holds (`assets/shapes/<name>.json`)."""
    return sorted(p.stem for p in SHAPES_DIR.glob("*.json"))


@dataclass
class PlannedModel:
    """The model `--model` names: its config (a directory AutoConfig reads) and, when present, its weights."""

    given: str  # as the user wrote it
    config_dir: Path  # holds config.json
    source: str  # where the facts come from: the public config's repo, or the path given
    config: dict = field(repr=False)
    weights: Path | None = None  # a checkpoint directory; None: planned by shape
    workdir: Path | None = None  # where random weights are written when the calibration needs them
    dtype: str = "float32"

    @property
    def by_shape(self) -> bool:
        return self.weights is None

    def weights_dir(self) -> Path:
        """The checkpoint the calibration loads: the model's own, else random weights of its shape, written now
        unless `workdir` holds them complete already (config.json is written last: a workdir the benchmarks keep)."""
        if self.weights is not None:
            return self.weights
        out = self.workdir / "random-weights"
        if not (out / "config.json").is_file():
            write_random_weights(self.config_dir, out, self.dtype)
        return out

    def note(self, calibrated: bool, tokenizer_dir: Path) -> str:
        """What the plan's reader must know about the model it planned."""
        if not self.by_shape:
            return f"model: {self.given} (its weights, {self.weights})"
        how = ("the calibration used a randomly initialised model of the same shape (time and memory do not depend "
               "on the weights' values)" if calibrated else "planned from its shape alone (not calibrated)")
        return (f"model: {self.given} by shape ({self.source}); no weights here: {how}; the rows' token counts are "
                f"the project's tokenizer's ({tokenizer_dir}).")


def _read_config(path: Path, given: str) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ShapeError(f"--model {given}: {path} is not a readable JSON config ({exc}); give a Hugging Face "
                         "config.json, a model directory or one of: " + ", ".join(names())) from None
    if not isinstance(config, dict):
        raise ShapeError(f"--model {given}: {path} holds {type(config).__name__}, not a config object.")
    check_config(config, f"--model {given}: {path}")
    return config


def check_config(config: dict, where: str) -> None:
    """ShapeError naming the first key that is missing or not a positive integer, or an unknown model_type."""
    from transformers import CONFIG_MAPPING

    for key in REQUIRED:
        value = config.get(key)
        if key == "model_type":
            if value not in CONFIG_MAPPING:
                raise ShapeError(f"{where}: model_type {value!r} is not an architecture transformers knows; set "
                                 "it as the model's own config.json does (e.g. llama, qwen2).")
        elif not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ShapeError(f"{where}: {key} = {value!r}, expected a positive integer (the model's config.json "
                             "has it).")


def resolve(model: str, workdir: Path, dtype: str = "float32") -> PlannedModel:
    """`--model`: a shape's name (`names()`, case-insensitive; an `org/` prefix and `-Instruct` are ignored), a
    config.json, or a model directory (with weights: planned with them; with config.json only: by shape).
    `workdir` (a temporary directory the caller removes) receives the config as AutoConfig reads it and, when the
    calibration needs them, random weights."""
    path = Path(model).expanduser()
    workdir = Path(workdir)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ShapeError(f"--model {model}: the directory has no config.json; give a Hugging Face model "
                             "directory, its config.json, or one of: " + ", ".join(names()))
        config = _read_config(path / "config.json", model)
        if any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
            return PlannedModel(model, path, str(path), config, weights=path, workdir=workdir, dtype=dtype)
        return _by_shape(model, str(path / "config.json"), config, workdir, dtype)
    if path.is_file():
        return _by_shape(model, str(path), _read_config(path, model), workdir, dtype)
    wanted = model.rsplit("/", 1)[-1].lower().removesuffix("-instruct")
    known = {name.lower(): name for name in names()}
    if wanted not in known:
        raise ShapeError(f"--model {model}: not a file, a directory or a known shape; known shapes: "
                         f"{', '.join(names())} (or give a config.json or a model directory).")
    config = _read_config(SHAPES_DIR / f"{known[wanted]}.json", model)
    return _by_shape(known[wanted], config["_source"], config, workdir, dtype)


def _by_shape(given: str, source: str, config: dict, workdir: Path, dtype: str) -> PlannedModel:
    config_dir = workdir / "config"
    config_dir.mkdir(parents=True, exist_ok=True)
    # the facts only: notes such as `_source` are not config attributes
    (config_dir / "config.json").write_text(json.dumps({k: v for k, v in config.items() if not k.startswith("_")},
                                                       indent=2))
    return PlannedModel(given, config_dir, source, config, workdir=workdir, dtype=dtype)


def check_vocabulary(model: PlannedModel, tokenizer_size: int, tokenizer_dir: Path) -> None:
    """The project's rows are token ids of its tokenizer: a model with a smaller vocabulary cannot embed them."""
    vocab = model.config["vocab_size"]
    if model.by_shape and tokenizer_size > vocab:
        raise ShapeError(f"--model {model.given}: its vocabulary ({vocab:,} tokens) is smaller than the project's "
                         f"tokenizer's ({tokenizer_size:,}, {tokenizer_dir}), whose ids the tokenized rows hold; "
                         "plan it from a directory with its weights and tokenizer (set model.source to it and run "
                         "`dvc repro tokenize`).")


def _causal_lm_on_meta(config_dir: Path, dtype: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(config_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return config, model


def write_random_weights(config_dir: Path, out_dir: Path, dtype: str = "float32", seed: int = 0) -> Path:
    """A checkpoint of the shape in `config_dir` with random weights, in `dtype`, at `out_dir`: written one tensor
    at a time (never the whole model in memory: a 3 B model in fp32 is 12 GiB), in safetensors shards with
    transformers' index, as `save_pretrained` lays out a model (tied weights once)."""
    import torch
    from safetensors.torch import save_file

    config, model = _causal_lm_on_meta(config_dir, dtype)
    tied = getattr(config, "tie_word_embeddings", False)
    tensors = [(name, p) for name, p in model.state_dict().items() if not (tied and name == "lm_head.weight")]
    total = sum(p.numel() * p.element_size() for _, p in tensors)
    out_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out_dir).free
    if free < total + GiB:
        raise ShapeError(f"random weights of this shape take {total / GiB:.1f} GiB, and {out_dir} has "
                         f"{free / GiB:.1f} GiB free: free disk space (or set TMPDIR to a larger disk), or plan "
                         "with --no-calibrate.")
    generator = torch.Generator().manual_seed(seed)
    std = float(getattr(config, "initializer_range", 0.02))
    shards: list[list[str]] = [[]]
    sizes = [0]
    for name, p in tensors:
        size = p.numel() * p.element_size()
        if shards[-1] and sizes[-1] + size > SHARD_BYTES:
            shards.append([])
            sizes.append(0)
        shards[-1].append(name)
        sizes[-1] += size
    shapes = dict(tensors)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
             for i in range(len(shards))]
    for file, shard in zip(files, shards):
        values = {}
        for name in shard:
            meta = shapes[name]
            if name.endswith("norm.weight") or meta.dim() == 1 and "norm" in name:
                values[name] = torch.ones(meta.shape, dtype=meta.dtype)  # as transformers initialises norms
            elif meta.dim() == 1:
                values[name] = torch.zeros(meta.shape, dtype=meta.dtype)  # biases
            else:
                values[name] = torch.empty(meta.shape, dtype=meta.dtype).normal_(0.0, std, generator=generator)
        save_file(values, str(out_dir / file), metadata={"format": "pt"})
        del values
    if len(files) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: file for file, shard in zip(files, shards) for name in shard}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    shutil.copy(config_dir / "config.json", out_dir / "config.json")
    return out_dir

