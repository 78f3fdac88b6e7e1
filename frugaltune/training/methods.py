"""Fine-tuning methods: wrap a classification model so that only the method's parameters train, save and reload them.

For `task.type: causal_lm` the same methods wrap the base model with its own LM head (no new head): LoRA/DoRA/QLoRA
adapt the attention projections, prelayer trains the (tied) embeddings, none evaluates the base model as it is.

Library code used by the `train` and `evaluate` stages. What each method is (what trains, whether its adapters
are DoRA's, whether its base is 4-bit) is its entry in the method registry (frugaltune/methods.py): the functions
here take the registry's `Method` (looked up once, by whoever read the name) and carry its facts out.

| method     | what trains                                             | saved as                                   |
| ---------- | ------------------------------------------------------- | ------------------------------------------ |
| `none`     | nothing (the base model with its fresh head, evaluated)  | `trainable.safetensors` (the head)         |
| `full`     | every parameter                                         | `trainable.safetensors` (all tensors)      |
| `lora`     | low-rank adapters on `target_modules` + the head        | PEFT adapter                               |
| `dora`     | weight-decomposed LoRA (peft `use_dora`) + the head      | PEFT adapter                               |
| `qlora`    | LoRA on a 4-bit NF4 base (bitsandbytes, double quant)   | PEFT adapter (applies to the full base)    |
| `prelayer` | token (and learned position) embeddings + the head      | `trainable.safetensors`                    |
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model, prepare_model_for_kbit_training
from safetensors.torch import load_file, save_file

from frugaltune import methods
from frugaltune.training.checkpoint import copy_named_tensors
from frugaltune.training.fast import fast_lora_dropout, frozen_projections_in_bf16, frozen_weights_in

# peft asks every model it wraps for `is_gradient_checkpointing`, which transformers 5 deprecated in favour of
# `is_activation_checkpointing`: a FutureWarning at every get_peft_model / PeftModel.from_pretrained that no change
# here can avoid. Only that message is ignored.
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)

TENSORS_FILE = "trainable.safetensors"
HEAD_NAMES = ("score", "classifier")
POSITION_EMBEDDINGS = ("embed_positions", "wpe", "position_embeddings")


def apply_lora(model: torch.nn.Module, r: int, alpha: int, dropout: float, target_modules: list[str],
               use_dora: bool = False, task: str = "classification", last_layers: int | None = None
               ) -> torch.nn.Module:
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [m for m in target_modules if m not in names]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"train.lora.target_modules: {missing} not found in the model. Its linear layers: {linear}.")
    # SEQ_CLS also trains (and saves) the new head; CAUSAL_LM keeps the base model's own LM head frozen
    task_type = TaskType.CAUSAL_LM if task == "causal_lm" else TaskType.SEQ_CLS
    layers = None
    if last_layers is not None:
        total = model.config.num_hidden_layers
        if last_layers > total:
            raise ValueError(f"train.lora.last_layers: {last_layers} but the model has {total} decoder layers; "
                             f"write at most {total}, or null for all")
        # Only the top layers adapt: autograd then stops at the lowest adapted layer, since nothing below it
        # (embeddings, frozen layers) requires grad, so the bottom layers run forward only.
        layers = list(range(total - last_layers, total))
    config = LoraConfig(task_type=task_type, r=r, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=list(target_modules), use_dora=use_dora, layers_to_transform=layers)
    return get_peft_model(model, config)


def prepare_qlora(model: torch.nn.Module, r: int, alpha: int, dropout: float, target_modules: list[str],
                  gradient_checkpointing: bool = False, task: str = "classification",
                  last_layers: int | None = None):
    """LoRA on a model loaded in 4 bit (see `frugaltune.models.qlora_quantization`).

    Gradient checkpointing only when the plan says memory requires it: on short sequences it costs time.
    """
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    own_loaded_tensors(model)
    return apply_lora(model, r, alpha, dropout, target_modules, task=task, last_layers=last_layers)


def _file_mappings() -> list[tuple[int, int]] | None:
    """The address ranges of this process's safetensors file mappings (None where /proc/self/maps is missing)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    ranges = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[-1].endswith(".safetensors"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def drop_file_pages(tensor: torch.Tensor, ranges: list[tuple[int, int]] | None) -> None:
    """Unmap the resident pages of `tensor`, a weight read from a safetensors file mapping (`ranges`) that its model
    no longer holds (frozen_weights_in replaced it): the whole pages inside it, so a neighbour's stay.

    Why: converting LoRA's frozen projections to bf16 reads every fp32 page of the mapping, and each page read
    stays resident until the whole mapping goes (own_loaded_tensors), beside the bf16 copies made meanwhile: the
    load's high-water mark was the fp32 file plus half of it again, which the plan's memory model (the model as
    held) does not count, and which refused LoRA at limits its steady state fits (docs/DECISIONS.md, "Loaded
    tensors are copied out of the safetensors mapping"). The pages stay in the page cache; were the tensor read
    again, they would be read back from the file."""
    if not ranges or tensor.device.type != "cpu":
        return
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    if not any(low <= start and end <= high for low, high in ranges):
        return
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    if last > first:
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED)


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def own_loaded_tensors(model: torch.nn.Module) -> int:
    """Copy the tensors that still alias the safetensors file mapping out of it; returns how many.

    Why: transformers loads zero-copy from an mmap of `model.safetensors`. Converting the weights (4-bit for QLoRA,
    bf16 for LoRA's frozen projections) reads every page of their fp32 values, and while one tensor (embeddings,
    norms, head) still aliases the mapping, every page read stays resident: the whole fp32 file (538 MB for
    SmolLM2-135M) counted in the process's RSS next to the converted copy. Copying the few tensors left in the
    mapping (108 MB) releases it (docs/DECISIONS.md has the figures). Where the address ranges cannot be read,
    every tensor but the 4-bit ones is copied. Not for a model whose weights stay as loaded: the mapping is then
    the weights themselves, resident only where read (a frozen embedding's unused rows never are)."""
    ranges = _file_mappings()

    def mapped(tensor: torch.Tensor) -> bool:
        return ranges is None or any(start <= tensor.data_ptr() < end for start, end in ranges)

    seen: set[int] = set()
    copied = 0
    for param in model.parameters():
        if id(param) in seen or param.__class__.__name__ == "Params4bit":
            continue
        seen.add(id(param))  # tied weights are one Parameter: copy once, the tie stays
        if mapped(param):
            param.data = param.data.clone()
            copied += 1
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and mapped(buffer):
                module._buffers[name] = buffer.clone()
                copied += 1
    return copied


def _set_trainable(model: torch.nn.Module, predicate) -> None:
    for name, param in model.named_parameters():
        param.requires_grad_(predicate(name))


def is_head(name: str) -> bool:
    return name.split(".")[0] in HEAD_NAMES


def _embeddings_and_head(model: torch.nn.Module):
    embeddings = model.get_input_embeddings()
    embedding_names = {n for n, p in model.named_parameters() if any(p is q for q in embeddings.parameters())}
    return lambda name: (name in embedding_names or is_head(name)
                         or any(f".{pos}." in f".{name}" for pos in POSITION_EMBEDDINGS))


# What trains, for the methods without adapters (`Method.trains`): a predicate on parameter names, given the model
_TRAINABLE = {
    "everything": lambda model: lambda name: True,
    "nothing": lambda model: lambda name: False,
    "embeddings": _embeddings_and_head,
}


def freeze_for(method: methods.Method, model: torch.nn.Module) -> torch.nn.Module:
    """The methods without adapters: choose which plain parameters train."""
    trainable = _TRAINABLE.get(method.trains)
    if trainable is None:
        raise ValueError(f"freeze_for: {method.name!r} trains adapters (peft chooses what trains); methods without: "
                         f"{', '.join(m.name for m in methods.METHODS.values() if not m.adapters)}")
    _set_trainable(model, trainable(model))
    return model


def save_trained(model: torch.nn.Module, method: methods.Method, out_dir: Path) -> None:
    """Methods with adapters save them (peft); the others the tensors they changed (the head included)."""
    if method.adapters:
        model.save_pretrained(out_dir)
        return
    trained = {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad or is_head(n)}
    save_file(trained, str(out_dir / TENSORS_FILE), metadata={"method": method.name})


def load_trained(model: torch.nn.Module, trained_dir: Path) -> torch.nn.Module:
    """Apply what `save_trained` wrote to a freshly loaded base classification model."""
    trained_dir = Path(trained_dir)
    if (trained_dir / "adapter_config.json").is_file():
        return PeftModel.from_pretrained(model, str(trained_dir))
    tensors_file = trained_dir / TENSORS_FILE
    if not tensors_file.is_file():
        raise FileNotFoundError(f"{trained_dir}: neither a PEFT adapter nor {TENSORS_FILE}. Run the train stage.")
    copy_named_tensors(model, load_file(str(tensors_file)), tensors_file)
    return model


def prepare_model(model_dir: Path | str, labels: list[str], pad_token_id: int, seed: int, method: methods.Method,
                  knobs: methods.MethodKnobs, bf16: bool = False, gradient_checkpointing: bool = False,
                  task: str = "classification") -> torch.nn.Module:
    """The base model with a fresh head (seeded), wrapped for `method`; `knobs`: its LoRA settings
    (`params.train.knobs(method)`; a method without adapters reads none).
    `task` causal_lm: the base model with its own LM head instead (no new head; `labels` unused).

    Shared by the `train` stage and the planner's calibration, so that what is measured is what trains.
    """
    from frugaltune.models import load_for_causal_lm, load_for_classification, qlora_quantization

    quantization = None
    if method.quantized_base:
        quantization = qlora_quantization(knobs.quant_type, knobs.double_quant,
                                          torch.bfloat16 if bf16 else torch.float32)
    if task == "causal_lm":
        model = load_for_causal_lm(model_dir, pad_token_id, seed, quantization_config=quantization)
    else:
        model = load_for_classification(model_dir, labels, pad_token_id, seed, quantization_config=quantization)
    if not method.quantized_base and torch.cuda.is_available():  # bitsandbytes places a 4-bit model itself
        model = model.to("cuda")
    if gradient_checkpointing:
        # Non-reentrant: works with frozen embeddings (no input gradients needed) and with peft.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if method.adapters and method.quantized_base:
        model = prepare_qlora(model, knobs.r, knobs.alpha, knobs.dropout, list(knobs.target_modules),
                              gradient_checkpointing, task, knobs.last_layers)
    elif method.adapters:
        model = apply_lora(model, knobs.r, knobs.alpha, knobs.dropout, list(knobs.target_modules),
                           use_dora=method.dora, task=task, last_layers=knobs.last_layers)
    else:
        return freeze_for(method, model)
    fast_lora_dropout(model)  # 4x fewer random draws, one dropout per input shared by q/k/v (training/fast.py)
    if frozen_projections_in_bf16(method, bf16):  # cast to bf16 once, not at every use (training/fast.py)
        ranges = _file_mappings()
        frozen_weights_in(model, torch.bfloat16, release=lambda old: drop_file_pages(old, ranges))
        own_loaded_tensors(model)  # their fp32 pages, read to convert, leave the process's RSS with the mapping
    return model
