"""Serve a fine-tuned causal LM: load the base model + adapter, answer prompts freely or among candidates.

Library code, not run directly: the pyfunc `GenerativeModel`, `frugaltune predict` and the scheduling LLM policy
load it (`load_generator`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from frugaltune import generation
from frugaltune.serving.classifier import texts_from
from frugaltune.serving.files import CAUSAL_LM, CLASSIFICATION, LABELS_FILE, TENSORS_FILE, check_model_dirs

PROMPT_COLUMN, CANDIDATES_COLUMN = "prompt", "candidates"
DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_GENERATION_BATCH_SIZE = 8


def _generation_settings(adapter_dir: Path) -> dict[str, Any]:
    """labels.json's "generation" block (max_new_tokens, temperature, system, templated), for a causal_lm adapter."""
    path = adapter_dir / LABELS_FILE
    stored = json.loads(path.read_text(encoding="utf-8"))
    if stored.get("task", CLASSIFICATION) != CAUSAL_LM:
        raise ValueError(f"{path}: task = {stored.get('task', CLASSIFICATION)!r}, not {CAUSAL_LM!r}: this adapter "
                         "classifies; load it with load_classifier.")
    settings = stored.get("generation") or {}
    if not isinstance(settings, dict):
        raise ValueError(f"{path}: \"generation\" is {type(settings).__name__}, expected an object with "
                         "max_new_tokens (int), temperature (float), system (str or null), templated (bool).")
    return settings


class Generator:
    """A loaded base model + adapter + tokenizer that answers prompts, freely or by choosing among candidates.

    `config`: max_new_tokens, temperature, system (None: the chat template's default), templated (whether prompts
    go through the chat template, as in training), labels (the task's answers when it had a fixed set: a labelled
    dataset through task.prompt_template; a prompt given no candidates then chooses among them, as evaluation
    scored it).
    """

    def __init__(self, model: Any, tokenizer: Any, config: dict[str, Any],
                 batch_size: int = DEFAULT_GENERATION_BATCH_SIZE):
        self.model = model
        self.tokenizer = tokenizer
        self.config = dict(config)
        self.batch_size = batch_size

    def prompt_ids(self, prompts: Sequence[str]) -> list[list[int]]:
        ids = []
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str):
                raise TypeError(f"prompt #{i} is {type(prompt).__name__} ({prompt!r}), expected a string.")
            ids.append(generation.prompt_ids(self.tokenizer, prompt, self.config.get("system"),
                                             bool(self.config["templated"])))
        return ids

    def predict(
        self,
        prompts: Sequence[str],
        candidates: Sequence[Sequence[str] | None] | None = None,
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
    ) -> list[str]:
        """The response per prompt, in input order. With `candidates` (one list per prompt, None for a prompt that
        has none), the likeliest candidate for those prompts; the others are generated, or, when the model was
        trained on a fixed label set (`config["labels"]`), choose among its labels."""
        ids = self.prompt_ids(list(prompts))
        if candidates is None:
            candidates = [None] * len(ids)
        labels = list(self.config.get("labels") or [])
        if labels:
            candidates = [labels if options is None else options for options in candidates]
        if len(candidates) != len(ids):
            raise ValueError(f"{len(ids)} prompts but {len(candidates)} candidate lists: give one per prompt.")
        responses: list[str] = [""] * len(ids)
        constrained = [i for i, options in enumerate(candidates) if options is not None]
        if constrained:
            options = [list(candidates[i]) for i in constrained]
            best, _ = generation.choose(self.model, self.tokenizer, [ids[i] for i in constrained], options,
                                        batch_size=2 * self.batch_size)
            for i, choices, chosen in zip(constrained, options, best):
                responses[i] = choices[chosen]
        free = [i for i, options in enumerate(candidates) if options is None]
        if free:
            if temperature is None:
                temperature = self.config.get("temperature") or 0.0
            generated = generation.generate(
                self.model,
                self.tokenizer,
                [ids[i] for i in free],
                max_new_tokens=int(max_new_tokens or self.config.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS),
                temperature=float(temperature),
                batch_size=self.batch_size,
            )
            for i, text in zip(free, generated):
                responses[i] = text
        return responses


def load_causal_lm(base_dir: str | Path, adapter_dir: str | Path) -> tuple[Any, Any]:
    """The base causal LM (float32, local files only) with the adapter applied, and the tokenizer (pad = EOS when
    missing). The adapter is a PEFT dir (adapter_config.json) or the tensors a method trained (trainable.safetensors),
    loaded by name. Returns the model unmerged: a `PeftModel` for PEFT adapters."""
    # bitsandbytes' offline notice (peft imports it): a loaded model runs these functions, pickled by value,
    # and never imports `frugaltune`, whose __init__ installs the filter elsewhere
    generation.quiet_bitsandbytes_hub_notice()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep `frugaltune predict` output to the predictions
    base_dir, adapter_dir = Path(base_dir), Path(adapter_dir)
    peft_adapter = check_model_dirs(base_dir, adapter_dir)
    tokenizer_dir = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base_dir
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    if peft_adapter:
        from peft import PeftModel

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecation chatter between peft and transformers
            model = PeftModel.from_pretrained(model, adapter_dir, local_files_only=True)
    else:  # the tensors the method trained (frugaltune.training.methods.save_trained), by name
        from safetensors.torch import load_file

        # Tied weights (lm_head = embed_tokens) are listed under both names, whichever one the file uses.
        params = dict(model.named_parameters(remove_duplicate=False))
        tensors = load_file(str(adapter_dir / TENSORS_FILE))
        unknown = sorted(set(tensors) - set(params))
        if unknown:
            raise ValueError(f"{adapter_dir / TENSORS_FILE}: tensors {unknown[:5]} are not parameters of "
                             f"{type(model).__name__} from {base_dir}: it was trained on another base model.")
        with torch.no_grad():
            for name, tensor in tensors.items():
                params[name].copy_(tensor)
    model.eval()
    return model, tokenizer


def load_generator(
    base_dir: str | Path,
    adapter_dir: str | Path,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
) -> Generator:
    """Load a causal_lm adapter for `Generator.predict`; the generation settings default to labels.json's."""
    settings = _generation_settings(Path(adapter_dir))
    settings["labels"] = json.loads((Path(adapter_dir) / LABELS_FILE).read_text(encoding="utf-8")).get("labels") or []
    model, tokenizer = load_causal_lm(base_dir, adapter_dir)
    if settings.get("templated") is None:  # trained before the flag was stored: what training's "auto" chose
        settings["templated"] = generation.uses_chat_template(tokenizer, "auto")
    settings["max_new_tokens"] = int(max_new_tokens or settings.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS)
    settings["temperature"] = float(settings.get("temperature") or 0.0) if temperature is None else float(temperature)
    return Generator(model, tokenizer, settings)


def prompts_from(model_input: Any) -> tuple[list[str], list[list[str]] | None]:
    """The prompts (and candidates, when given) in a pyfunc input: a DataFrame with `prompt` (or its only column)
    and an optional `candidates` column (a list of strings per row), a Series, a list, a str."""
    if isinstance(model_input, pd.DataFrame):
        if CANDIDATES_COLUMN in model_input.columns:
            rest = [c for c in model_input.columns if c != CANDIDATES_COLUMN]
            prompts, _ = prompts_from(model_input[rest])
            candidates = [_candidate_list(value, i) for i, value in enumerate(model_input[CANDIDATES_COLUMN])]
            return prompts, (None if all(c is None for c in candidates) else candidates)
        if PROMPT_COLUMN in model_input.columns:
            return model_input[PROMPT_COLUMN].tolist(), None
        if len(model_input.columns) == 1:
            return model_input.iloc[:, 0].tolist(), None
        raise ValueError(
            f"Expected a DataFrame with a `{PROMPT_COLUMN}` column (and optionally `{CANDIDATES_COLUMN}`), "
            f"got columns {list(model_input.columns)}."
        )
    if isinstance(model_input, dict) and PROMPT_COLUMN in model_input:
        return prompts_from(pd.DataFrame({k: v for k, v in model_input.items()
                                          if k in (PROMPT_COLUMN, CANDIDATES_COLUMN)}))
    return texts_from(model_input), None


def _candidate_list(value: Any, row: int) -> list[str] | None:
    if value is None or (isinstance(value, float) and value != value):  # a row without candidates: NaN / None
        return None
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise TypeError(f"candidates of row {row} = {value!r}: expected a list of strings.")
    return [str(option) for option in value]
