"""Prompt -> response models: how prompts and responses become token ids, batched generation, constrained choice
among candidate answers, and the answer metrics (exact match, token F1, a user scorer).

Library code, not run directly. Training (`causal_lm` task), evaluation and serving all call it, so a prompt is
tokenized one way everywhere:

    templated = uses_chat_template(tokenizer, "auto")
    ids = prompt_ids(tokenizer, "What is 2+2?", system=None, templated=templated)
    generate(model, tokenizer, [ids], max_new_tokens=32)                 # -> ["4"]
    choose(model, tokenizer, [ids], [["4", "5"]])                        # -> ([0], [[-1.2, -7.9]])

This module must import nothing from the rest of the project: `frugaltune.serving.pyfunc.log_model` pickles it by value
into the logged model, like serving itself, so a registered version loads without `frugaltune` installed.
"""

from __future__ import annotations

import importlib
import logging
import re
import string
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

CHAT_TEMPLATE_MODES = ("auto", "always", "never")

_BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"


class _NoHubKernelNotice(logging.Filter):
    """Drops bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" warning.

    On CPUs with avx512_bf16, importing bitsandbytes (peft imports it whenever it is installed) tries to fetch a
    kernel from the Hugging Face hub and warns when it cannot. frugaltune never downloads at run time (offline by
    design), so the fallback it warns about is the intended path and the warning is noise; any other bitsandbytes
    message passes. It lives here, not in `frugaltune/__init__`, because a registered model loads this module by
    value without importing the package.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in str(record.msg)


def quiet_bitsandbytes_hub_notice() -> None:
    """Install the filter on bitsandbytes' CPU logger, once per process (loggers outlive the modules that add to
    them, and this runs both from `import frugaltune` and from a loaded model)."""
    logger = logging.getLogger(_BNB_CPU_LOGGER)
    # by name: a by-value copy of this module (a loaded model) has its own class object
    if not any(type(f).__name__ == _NoHubKernelNotice.__name__ for f in logger.filters):
        logger.addFilter(_NoHubKernelNotice())

ROLES = ("system", "user", "assistant", "tool")


# ----------------------------------------------------------------------------------------------- prompts


def uses_chat_template(tokenizer: Any, chat_template: str) -> bool:
    """Whether prompts go through the tokenizer's chat template: "auto" (if it has one), "always", "never"."""
    if chat_template not in CHAT_TEMPLATE_MODES:
        raise ValueError(f"chat_template = {chat_template!r}: expected one of {', '.join(CHAT_TEMPLATE_MODES)}.")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat_template == "always" and not has_template:
        raise ValueError(
            f"chat_template = 'always', but the tokenizer ({getattr(tokenizer, 'name_or_path', '') or 'loaded'}) "
            "has no chat template. Use chat_template: auto (plain prompts for such tokenizers), or a base model "
            "whose tokenizer_config.json / chat_template.jinja defines one."
        )
    return has_template and chat_template != "never"


def format_prompt(tokenizer: Any, prompt: str, system: str | None, templated: bool) -> str:
    """The text the model sees before its response. Templated: the chat template with the generation prompt
    (no system message when `system` is None, so the template adds its own default); else the prompt as is."""
    if not templated:
        return prompt
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def template_plain_strings(tokenizer: Any, system: str | None) -> None:
    """Make `tokenizer(prompt)` give exactly `prompt_ids(tokenizer, prompt, system, templated=True)`: the chat
    template's text before and after the user's prompt become the fast tokenizer's post-processor. A model trained
    on templated prompts then answers a plain string too (transformers' text-generation pipeline applies the chat
    template to chat messages only and tokenizes a string with the tokenizer's special tokens); without this, the
    string goes in raw and the model, which learned to answer only after the template's assistant turn, ends at
    once with an empty answer. The chat-template path is unchanged (it tokenizes without special tokens).

    Raises ValueError when the template does not put the prompt in one place or the tokenizer is not a fast one.
    """
    from tokenizers.processors import TemplateProcessing

    backend = getattr(tokenizer, "backend_tokenizer", None)
    marker = "\x00frugaltune-prompt\x00"
    parts = format_prompt(tokenizer, marker, system, templated=True).split(marker)
    if backend is None or len(parts) != 2:
        raise ValueError(f"the tokenizer ({getattr(tokenizer, 'name_or_path', '')}) is not a fast tokenizer whose "
                         "chat template holds the prompt once: plain strings cannot be templated; pass chat messages.")
    before, after = (list(tokenizer(part, add_special_tokens=False)["input_ids"]) for part in parts)
    # TemplateProcessing's "special tokens" may be many ids each: the whole text around the prompt
    pieces = {name: ids for name, ids in (("[PROMPT_BEFORE]", before), ("[PROMPT_AFTER]", after)) if ids}
    single = (["[PROMPT_BEFORE]"] if before else []) + ["$A"] + (["[PROMPT_AFTER]"] if after else [])
    backend.post_processor = TemplateProcessing(single=" ".join(single), special_tokens=[
        {"id": name, "ids": ids, "tokens": tokenizer.convert_ids_to_tokens(ids)} for name, ids in pieces.items()])


def _encode_prompt(tokenizer: Any, text: str, templated: bool) -> list[int]:
    # Chat-templated text already holds the special tokens (<|im_start|> ...); adding a BOS again would put a
    # token there that the model never saw in that place.
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])


def prompt_ids(tokenizer: Any, prompt: str, system: str | None, templated: bool) -> list[int]:
    """Token ids of the formatted prompt: the one definition training, evaluation and serving share."""
    return _encode_prompt(tokenizer, format_prompt(tokenizer, prompt, system, templated), templated)


def response_ids(tokenizer: Any, response: str) -> list[int]:
    """Token ids of a response, ending with EOS: the model learns to stop, and generation stops there."""
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer ({getattr(tokenizer, 'name_or_path', '')}) has no eos_token; a response "
                         "needs one to end. Set tokenizer.eos_token (in tokenizer_config.json) on the base model.")
    return list(tokenizer(response, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]


def split_messages(messages: Sequence[dict]) -> tuple[list[dict], str]:
    """A chat-format row -> (the context messages, the response): the last message is the assistant's answer.

    Raises ValueError saying what is wrong with a malformed row.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or len(messages) < 2:
        raise ValueError(
            f"messages = {str(messages)[:200]!r}: expected a list of at least two {{'role': ..., 'content': ...}} "
            "dicts, the last from the assistant (the response) and the ones before it the prompt."
        )
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"messages[{i}] = {str(message)[:200]!r}: expected a dict with 'role' and 'content'.")
        if message["role"] not in ROLES:
            raise ValueError(f"messages[{i}]: role {message['role']!r} is not one of {', '.join(ROLES)}.")
        if not isinstance(message["content"], str):
            raise ValueError(f"messages[{i}]: content is {type(message['content']).__name__}, expected a string.")
    if messages[-1]["role"] != "assistant":
        raise ValueError(f"messages[-1]: role is {messages[-1]['role']!r}; the last message must be the "
                         "'assistant' response the model learns to give.")
    if all(m["role"] == "system" for m in messages[:-1]):
        raise ValueError("messages: no 'user' (or other non-system) message before the assistant's response.")
    return [dict(m) for m in messages[:-1]], messages[-1]["content"]


def format_messages_prompt(tokenizer: Any, context_messages: Sequence[dict], templated: bool) -> str:
    """The text before the response for chat-format rows: the chat template with the generation prompt, or
    without a template the contents joined by newlines (a newline ends it, where the response starts)."""
    if templated:
        return tokenizer.apply_chat_template(list(context_messages), tokenize=False, add_generation_prompt=True)
    return "\n".join(m["content"] for m in context_messages) + "\n"


def messages_prompt_ids(tokenizer: Any, context_messages: Sequence[dict], templated: bool) -> list[int]:
    """Token ids of `format_messages_prompt`, special tokens as `prompt_ids` adds them."""
    return _encode_prompt(tokenizer, format_messages_prompt(tokenizer, context_messages, templated), templated)


# ----------------------------------------------------------------------------------------------- generation


def _progress(iterable: Any, total: int, progress: bool, desc: str) -> Any:
    if not progress:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="batch")


@contextmanager
def contiguous_head_input(model: Any) -> Iterator[None]:
    """While inside, the model's output head (`get_output_embeddings()`, the LM head) gets a contiguous input.

    Why: a causal LM asked for the last position's logits only (`logits_to_keep=1`, as `choose` and HF `generate`'s
    prefill do) slices `hidden[:, -1:, :]`, a non-contiguous [batch, 1, hidden] view. torch.matmul (torch 2.13)
    folds such a view into one 2D matmul only when the weight requires grad; for a frozen weight (a merged or
    PEFT-loaded model: every base parameter frozen) it expands the weight to [batch, hidden, vocab] and copies it,
    1.1 GB for 20 prompts and SmolLM2's 49,152 x 576 head, two orders of magnitude slower than the same product
    (docs/DECISIONS.md, "Constrained choice"). Copying the 20 x 576 input costs nothing.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        yield
        return
    handle = head.register_forward_pre_hook(lambda module, args: (args[0].contiguous(), *args[1:]))
    try:
        yield
    finally:
        handle.remove()


def _pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad_token nor an eos_token; set tokenizer.pad_token.")
    return pad


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    batch_size: int = 8,
    seed: int = 0,
    progress: bool = False,
) -> list[str]:
    """The response to each prompt (token ids from `prompt_ids`), decoded and stripped, in input order.

    Greedy when `temperature` is 0, else sampling at that temperature (whole distribution: no top-k / top-p),
    seeded by `seed` without touching the caller's random state. Stops at EOS or after `max_new_tokens`.
    """
    import torch

    if temperature < 0:
        raise ValueError(f"temperature = {temperature}: must be >= 0 (0 = greedy).")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens}: must be >= 1.")
    pad, eos = _pad_id(tokenizer), tokenizer.eos_token_id
    sampling = {"do_sample": True, "temperature": float(temperature), "top_k": 0, "top_p": 1.0} if temperature > 0 \
        else {"do_sample": False}
    # Prompts of similar length in one batch pad less; the results go back to input order.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[str] = [""] * len(prompts)
    batches = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), torch.random.fork_rng(devices=[]), contiguous_head_input(model):
            torch.manual_seed(seed)
            for batch in _progress(batches, len(batches), progress, "generate"):
                width = max(len(prompts[i]) for i in batch)
                if width == 0:
                    raise ValueError("an empty prompt (no token ids): the model needs at least one token to continue.")
                # LEFT padding: every row's last prompt token sits in the last column, where generation continues.
                input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
                attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
                for row, i in enumerate(batch):
                    n = len(prompts[i])
                    if n:
                        input_ids[row, width - n:] = torch.tensor(list(prompts[i]), dtype=torch.long)
                        attention_mask[row, width - n:] = 1
                generated = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                           max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=eos,
                                           **sampling)
                for row, i in enumerate(batch):
                    outputs[i] = tokenizer.decode(generated[row, width:], skip_special_tokens=True).strip()
    finally:
        model.train(was_training)
    return outputs


def choose(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    candidates: Sequence[Sequence[str]],
    batch_size: int = 16,
    min_shared_prefix: int = 8,
) -> tuple[list[int], list[list[float]]]:
    """Constrained answer: per prompt, the index of the candidate the model finds most likely, and every score.

    A candidate's score is the summed log-probability of its `response_ids` (tokens + EOS, so a candidate that is
    only the start of a likelier answer does not win) given the prompt. Each prompt is read once, `batch_size`
    prompts per forward (left padded, positions counted from each prompt's first token); its last position scores
    every candidate's first token, and its KV cache, shared by all its candidates, feeds one more forward over the
    candidates' remaining tokens laid side by side after it (`_score_tails`). No generation loop, and the prompt,
    which is most of the tokens, is neither recomputed nor copied per candidate. The tokens every prompt starts with
    (a chat template's system turn, an instruction: ~20% of a scheduling prompt) are read once per call when there
    are at least `min_shared_prefix` of them: their KV cache is copied to each batch, whose prompts continue it left
    padded between the shared part and their own (positions as if unpadded, so the scores are those of the whole
    prompt).
    """
    import copy

    import torch

    if len(prompts) != len(candidates):
        raise ValueError(f"{len(prompts)} prompts but {len(candidates)} candidate lists: give one list per prompt.")
    answers: list[list[list[int]]] = []
    for example, (prompt, options) in enumerate(zip(prompts, candidates)):
        if isinstance(options, str) or not options:
            raise ValueError(f"candidates[{example}] = {options!r}: expected a non-empty list of strings.")
        if not prompt:
            raise ValueError(f"prompts[{example}] is empty: a candidate's first token needs a token to follow.")
        answers.append([response_ids(tokenizer, str(option)) for option in options])
    pad = _pad_id(tokenizer)
    scores: list[list[float]] = [[0.0] * len(options) for options in answers]
    order = sorted(range(len(prompts)), key=lambda e: len(prompts[e]))
    # Every prompt keeps at least its last token: that position scores the candidates' first tokens.
    shared = min(_common_prefix_length(prompts), min(len(p) for p in prompts) - 1)
    shared = shared if len(prompts) > 1 and shared >= min_shared_prefix else 0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), contiguous_head_input(model):
            prefix_cache = None
            if shared:
                prefix_cache = model(input_ids=torch.tensor([list(prompts[0][:shared])], dtype=torch.long),
                                     use_cache=True, logits_to_keep=1).past_key_values
            for start in range(0, len(order), batch_size):
                group = order[start:start + batch_size]
                width = max(len(prompts[e]) for e in group) - shared
                input_ids = torch.full((len(group), width), pad, dtype=torch.long)
                own = torch.zeros((len(group), width), dtype=torch.long)
                for row, e in enumerate(group):  # LEFT padding: every prompt ends at the last column
                    input_ids[row, width - len(prompts[e]) + shared:] = torch.tensor(list(prompts[e][shared:]),
                                                                                     dtype=torch.long)
                    own[row, width - len(prompts[e]) + shared:] = 1
                # as in training: 0 at each prompt's first token (the shared part holds 0 .. shared-1)
                positions = shared + (own.cumsum(-1) - 1).clamp(min=0)
                cache = None
                if prefix_cache is not None:
                    cache = copy.deepcopy(prefix_cache)
                    cache.batch_repeat_interleave(len(group))
                mask = torch.cat([torch.ones((len(group), shared), dtype=torch.long), own], dim=1)
                out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                            use_cache=True, logits_to_keep=1)
                first = out.logits[:, -1].float().log_softmax(dim=-1)  # the first answer token, for every candidate
                rows = [(row, e, k) for row, e in enumerate(group) for k in range(len(answers[e]))]
                for row, e, k in rows:
                    scores[e][k] = float(first[row, answers[e][k][0]])
                _score_tails(model, [answers[e] for e in group], mask,
                             out.past_key_values, pad, [scores[e] for e in group])
    finally:
        model.train(was_training)
    # max over indices keeps the first of equal scores: ties go to the earlier candidate.
    best = [max(range(len(s)), key=s.__getitem__) for s in scores]
    return best, scores


def _score_tails(model: Any, answers: Sequence[Sequence[Sequence[int]]], prompt_mask: Any, cache: Any, pad: int,
                 scores: Sequence[list[float]]) -> None:
    """Add to `scores[row][k]` the log-probabilities of the tokens after the first of `answers[row][k]`, every
    candidate of every prompt in ONE forward that continues the prompts' KV cache `cache` (grown in place).

    Each prompt's candidates are laid side by side after it ("tree attention"): a token sees its prompt (the
    2D `prompt_mask` row) and the earlier tokens of its own candidate, never another candidate's, and its position
    counts from the prompt's end as if that candidate were the only one. The 4D additive mask that says so is passed
    to the model as is. This replaces a forward over one row per candidate, whose cache had to be copied per
    candidate (with 8 letters and a 200-token scheduling prompt, a fifth of the choosing time; measured by
    the answered experiment in docs/DECISIONS.md, "Constrained choice").
    """
    import torch

    tails = [[answer[:-1] for answer in row] for row in answers]  # the last token is only predicted, never fed
    width = max(sum(len(tail) for tail in row) for row in tails)
    if width == 0:
        return
    rows, past = len(answers), prompt_mask.shape[1]
    ids = torch.full((rows, width), pad, dtype=torch.long)
    positions = torch.zeros((rows, width), dtype=torch.long)
    allowed = torch.zeros((rows, width, past + width), dtype=torch.bool)
    allowed[:, :, :past] = prompt_mask.bool().unsqueeze(1)
    where: list[tuple[int, int, int, int]] = []  # (row, column, candidate, target token)
    for row, row_tails in enumerate(tails):
        column, end = 0, int(prompt_mask[row].sum())  # a prompt of n tokens holds positions 0 .. n-1
        for k, tail in enumerate(row_tails):
            n = len(tail)
            if n == 0:
                continue
            ids[row, column:column + n] = torch.tensor(list(tail), dtype=torch.long)
            positions[row, column:column + n] = end + torch.arange(n)
            allowed[row, column:column + n, past + column:past + column + n] = torch.ones(n, n, dtype=torch.bool).tril()
            where += [(row, column + i, k, answers[row][k][i + 1]) for i in range(n)]
            column += n
        for j in range(column, width):  # padding: sees itself only (no row of the softmax is empty)
            allowed[row, j, past + j] = True
    dtype = model.get_input_embeddings().weight.dtype
    bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)
    logits = model(input_ids=ids, attention_mask=bias, position_ids=positions, past_key_values=cache,
                   use_cache=True).logits
    at_rows = torch.tensor([w[0] for w in where])
    at_columns = torch.tensor([w[1] for w in where])
    logprobs = logits[at_rows, at_columns].float().log_softmax(dim=-1)
    picked = logprobs[torch.arange(len(where)), torch.tensor([w[3] for w in where])].tolist()
    for (row, _, k, _), value in zip(where, picked):
        scores[row][k] += value


# ----------------------------------------------------------------------------------------------- metrics

_PUNCTUATION = string.punctuation + "“”‘’«»…–—"


def _common_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    first = prompts[0]
    length = min(len(p) for p in prompts)
    for prompt in prompts[1:]:
        length = next((i for i in range(length) if prompt[i] != first[i]), length)
    return length


def normalize_answer(text: str) -> str:
    """Casefolded, whitespace collapsed, surrounding punctuation stripped: "  The  Answer. " -> "the answer"."""
    return " ".join(str(text).casefold().split()).strip(_PUNCTUATION + " ")


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the normalized strings are equal, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(reference))


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD-style F1 over the whitespace tokens (a bag, counts matter) of the normalized strings.

    Both empty: 1.0; one empty: 0.0.
    """
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def load_scorer(dotted: str) -> Callable[[str, str, str], float]:
    """The user's metric `score(prompt, prediction, reference) -> float`, from "package.module:function" or
    "package.module.function". Modules in the current working directory are importable (the project's own)."""
    import os

    if not isinstance(dotted, str) or not re.fullmatch(r"[\w.]+(:[\w.]+)?", dotted or ""):
        raise ValueError(f"scorer = {dotted!r}: expected 'package.module:function' (or 'package.module.function').")
    if ":" in dotted:
        module_name, attribute = dotted.split(":", 1)
    elif "." in dotted:
        module_name, attribute = dotted.rsplit(".", 1)
    else:
        raise ValueError(f"scorer = {dotted!r}: names no function; write 'module:function', e.g. 'my_metrics:score'.")
    # Stages run from the project root; a scorer module there must import, as `python -m` would find it.
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(
            f"scorer = {dotted!r}: cannot import module {module_name!r} ({exc}). Put {module_name.replace('.', '/')}"
            f".py in the project root ({cwd}) or install it."
        ) from None
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"scorer = {dotted!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) "
                             f"has no {attribute!r}. Define `def {part}(prompt, prediction, reference) -> float`.")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"scorer = {dotted!r}: {attribute!r} is a {type(target).__name__}, not a function "
                         "`score(prompt, prediction, reference) -> float`.")
    return target
