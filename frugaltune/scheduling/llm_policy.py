"""The LLM scheduling policy: a causal LM picks the next job by constrained choice among the visible jobs' letters.

Library code, used by the scheduling pipeline's `evaluate_policy` stage (`python -m stages.evaluate_policy`):

    policy = load_llm_policy("models/base", "models/adapter", fallback="F1")   # fine-tuned
    policy = load_llm_policy("models/base", None)                              # the untuned base model
    policy = load_registered_llm_policy("models:/frugaltune-scheduler@champion")  # from the MLflow registry
    results = simulate_batch(sequences, total_procs, policy, window=8)          # one forward per round
    policy.stats()   # decisions, model calls, decisions/s

How it decides, per decision (a `SchedulerState`):
- One visible job: that job, without the model (there is nothing to choose; counted as a decision, not a call).
- Two or more: the prompt `sft.encode_state(state)` (the text the model was fine-tuned on), then
  `frugaltune.generation.choose` among the letters "A", "B", ... of the visible jobs: the model scores each
  letter (+ EOS) after the prompt and the likeliest wins. Only visible jobs can be answered, so no answer is
  invalid. A visible job that does not fit the free processors *is* a valid answer: choices are committed (see
  simulator.py), so choosing a wide job reserves the machine for it; the model is asked even when one job fits.
- `choose_many(states)`: the same for several decisions at once (one batched forward), which `simulate_batch`
  uses to run many sequences in lockstep.

**Inference precision** (`bf16=`): the scheduling pipeline chooses in the precision training ran in (the plan's,
measured faster on this CPU). A LoRA/DoRA adapter is merged into the base weights first (one matmul per projection
instead of three; the same function up to rounding), then the weights are cast: bf16 *weights*, not autocast,
since autocast re-casts every fp32 weight on every forward. Measured on the 2-core AMD EPYC Zen 4 with the untuned
SmolLM2-135M-Instruct, 80 scheduling prompts of 195 tokens, 20 per forward: fp32 2.79 decisions/s, fp32 weights
under bf16 autocast 3.77, bf16 weights 5.22 (1.87x fp32).

When the model cannot be loaded (no adapter dir, a broken file), `load_llm_policy` returns the named fallback
heuristic instead, under a name that says so ("F1 (fallback: ...)"), and logs why on stderr; a report built from
it can never be mistaken for the LLM's.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from frugaltune.scheduling.policies import HEURISTICS, ScorePolicy
from frugaltune.scheduling.sft import encode_state, job_labels, listed
from frugaltune.scheduling.simulator import JobView, SchedulerState


class LLMPolicy:
    """A causal LM (with or without an adapter) as a `Policy`; see the module docstring.

    Args:
        model: a causal LM (a PeftModel or a plain transformers model), in eval mode.
        tokenizer: its tokenizer (with a pad token).
        templated: whether prompts go through the chat template (as in training; `generation.uses_chat_template`).
        system: the system message used in training (None: the template's default).
        name: how tables and plots call this policy.
        max_running: running jobs listed in the prompt (as in the SFT data).
        batch_size: prompts per forward in `choose_many`.
        order: how prompts letter the visible jobs (`sft.listed`), as in the SFT data.
    """

    def __init__(self, model: Any, tokenizer: Any, *, templated: bool, system: str | None = None,
                 name: str = "llm", max_running: int = 4, batch_size: int = 16, order: str = "queue"):
        self.model = model
        self.tokenizer = tokenizer
        self.templated = templated
        self.system = system
        self.name = name
        self.max_running = max_running
        self.batch_size = batch_size
        self.order = order
        self.decisions = 0
        self.model_calls = 0
        self.seconds = 0.0

    def choose(self, state: SchedulerState) -> JobView:
        return self.choose_many([state])[0]

    def choose_many(self, states: Sequence[SchedulerState]) -> list[JobView]:
        from frugaltune.generation import choose, prompt_ids

        began = time.perf_counter()
        answers: list[JobView | None] = [state.queue[0] if len(state.queue) == 1 else None for state in states]
        asked = [i for i, answer in enumerate(answers) if answer is None]
        if asked:
            ids = [prompt_ids(self.tokenizer, encode_state(states[i], self.max_running, self.order), self.system,
                              self.templated) for i in asked]
            options = [job_labels(len(states[i].queue)) for i in asked]
            best, _ = choose(self.model, self.tokenizer, ids, options, batch_size=self.batch_size)
            for i, position in zip(asked, best):
                answers[i] = listed(states[i], self.order)[position]
        self.decisions += len(states)
        self.model_calls += len(asked)
        self.seconds += time.perf_counter() - began
        return answers  # type: ignore[return-value]  # every entry is set above

    def stats(self) -> dict:
        """Decisions made, how many asked the model, the time spent choosing and the rate."""
        return {"decisions": self.decisions, "model_calls": self.model_calls, "seconds": self.seconds,
                "decisions_per_s": self.decisions / self.seconds if self.seconds > 0 else 0.0,
                "model_calls_per_s": self.model_calls / self.seconds if self.seconds > 0 else 0.0}


def fallback_policy(name: str, reason: str) -> ScorePolicy:
    """The heuristic `name` standing in for a model that did not load, named so that no table mistakes it."""
    if name not in HEURISTICS:
        raise ValueError(f"scheduling.llm.fallback = {name!r}: not a heuristic; choose from {', '.join(HEURISTICS)}.")
    print(f"llm policy: the model is not loaded ({reason}); using the fallback heuristic {name}", file=sys.stderr)
    return ScorePolicy(f"{name} (fallback: model not loaded)", HEURISTICS[name].score)


def for_inference(model: Any, bf16: bool = False) -> Any:
    """`model` ready to choose: a peft adapter merged into its base weights, the weights in bf16 when `bf16`."""
    import torch
    from peft import PeftModel

    if isinstance(model, PeftModel):
        model = model.merge_and_unload()  # in place: the generator it came from is not used again
    if bf16:
        model = model.to(torch.bfloat16)
    return model.eval()


def load_llm_policy(base_dir: str | Path, adapter_dir: str | Path | None, *, name: str = "llm",
                    fallback: str | None = None, threads: int | None = None, bf16: bool = False,
                    **options: Any) -> LLMPolicy | ScorePolicy:
    """The policy of the base model in `base_dir` with the causal_lm adapter in `adapter_dir` (None: the base model
    untuned, prompts templated as training's "auto" would), merged and in bf16 when `bf16` (`for_inference`).
    With `fallback` (a heuristic's name), a model that cannot be loaded gives that heuristic (see
    `fallback_policy`); without it, the error propagates."""
    import torch

    from frugaltune.generation import uses_chat_template

    if threads:
        torch.set_num_threads(threads)
    try:
        if adapter_dir is None:
            from transformers import AutoModelForCausalLM

            from frugaltune.models import load_tokenizer

            if not Path(base_dir).is_dir():
                raise FileNotFoundError(f"{base_dir}: base model not found. Run the import_model stage first.")
            tokenizer = load_tokenizer(base_dir)
            model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32,
                                                         local_files_only=True)
            return LLMPolicy(for_inference(model, bf16), tokenizer, templated=uses_chat_template(tokenizer, "auto"),
                             name=name, **options)
        from frugaltune.serving import load_generator

        return policy_from_generator(load_generator(base_dir, adapter_dir), name, bf16=bf16, **options)
    except (OSError, ValueError) as exc:
        if fallback is None:
            raise
        return fallback_policy(fallback, f"{type(exc).__name__}: {exc}")


def policy_from_generator(generator: Any, name: str = "llm", bf16: bool = False, **options: Any) -> LLMPolicy:
    """An `LLMPolicy` on a `serving.Generator`'s model (merged, see `for_inference`), with the templating and
    system message it was trained with."""
    return LLMPolicy(for_inference(generator.model, bf16), generator.tokenizer,
                     templated=bool(generator.config["templated"]), system=generator.config.get("system"), name=name,
                     **options)


def load_registered_llm_policy(model_uri: str, *, name: str = "llm", fallback: str | None = None,
                               **options: Any) -> LLMPolicy | ScorePolicy:
    """The policy of a registered generative model (`models:/frugaltune-scheduler@champion`, a `runs:/` URI):
    the logged pyfunc is loaded by MLflow and its generator reused. `fallback` as for `load_llm_policy`."""
    import mlflow.pyfunc
    from mlflow.exceptions import MlflowException

    try:
        generator = getattr(mlflow.pyfunc.load_model(model_uri).unwrap_python_model(), "_generator", None)
        if generator is None:
            raise ValueError(f"{model_uri} is not a generative (causal_lm) model: it has no generator to schedule "
                             "with. Register the scheduling pipeline's model (make schedule).")
        return policy_from_generator(generator, name, **options)
    except (OSError, ValueError, MlflowException) as exc:
        if fallback is None:
            raise
        return fallback_policy(fallback, f"{type(exc).__name__}: {exc}")
