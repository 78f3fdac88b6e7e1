"""A classifier's input template: the same text around every input, e.g. `{text}\\nSentiment:`.

Not run on its own. The train stage reads it from `train.input_template` and records it in the adapter's labels.json
("input_template"); the evaluate stage and serving (`serving.classifier.Classifier`) read it from there, so every
consumer wraps its inputs exactly as the model was trained, whatever params.yaml says later.

Why: a sequence classifier reads its features at each row's last token, which for a bare tweet is whatever the tweet
ends with. A fixed suffix makes that position the same prompt in every row (docs/DECISIONS.md, "A fixed prompt after
each tweet": +0.015 test macro-F1 over three seeds here).

The wrap works on token ids, not text: the template's two sides are tokenized once, and each row keeps the ids the
tokenize stage (or serving's tokenizer) gave it, cut from its end so that the whole fits `tokenize.max_length`. The
suffix thus always survives truncation, and train, evaluate and serve see the same ids for the same text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

PLACEHOLDER = "{text}"


def sides(template: str) -> tuple[str, str]:
    """The text before and after `{text}`; the template must hold it exactly once."""
    if template.count(PLACEHOLDER) != 1:
        raise ValueError(f"input template {template!r} must contain {PLACEHOLDER} exactly once (where the input goes)")
    before, _, after = template.partition(PLACEHOLDER)
    return before, after


@dataclass(frozen=True)
class InputTemplate:
    template: str
    before: tuple[int, ...]
    after: tuple[int, ...]
    lead: int = 0   # special tokens the tokenizer puts before a text (a BOS): the template goes after them
    trail: int = 0  # ... and after it (an EOS): the template goes before them

    @classmethod
    def build(cls, template: str, tokenizer: Any) -> "InputTemplate":
        before, after = (tuple(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else ()
                         for text in sides(template))
        # Where the tokenizer's own special tokens sit around a text, found on a probe text.
        plain = tokenizer("a", add_special_tokens=False)["input_ids"]
        full = tokenizer("a")["input_ids"]
        lead = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
        return cls(template, before, after, lead, len(full) - lead - len(plain))

    @property
    def extra(self) -> int:
        """Tokens the template adds to every row."""
        return len(self.before) + len(self.after)

    def room(self, max_length: int) -> int:
        """Tokens of the input itself that fit beside the template and the special tokens."""
        room = max_length - self.extra - self.lead - self.trail
        if room < 1:
            raise ValueError(f"input template {self.template!r} takes {self.extra} tokens, which leaves no room for the "
                             f"input under max_length {max_length}. Shorten the template or raise tokenize.max_length.")
        return room

    def wrap(self, row: Sequence[int], max_length: int) -> list[int]:
        """One tokenized row as lead specials + before + the row's text ids (cut to fit) + after + trail specials."""
        row = list(row)
        end = len(row) - self.trail
        body = row[self.lead:end][:self.room(max_length)]
        return row[:self.lead] + list(self.before) + body + list(self.after) + row[end:]

    def wrap_all(self, rows: Sequence[Sequence[int]], max_length: int) -> list[list[int]]:
        return [self.wrap(row, max_length) for row in rows]


def from_manifest(manifest: dict, tokenizer: Any) -> InputTemplate | None:
    """The template an adapter was trained with (labels.json "input_template"), or None."""
    template = manifest.get("input_template")
    return InputTemplate.build(template, tokenizer) if template else None


def wrapped(rows: Sequence[Sequence[int]], template: InputTemplate | None, max_length: int) -> Sequence[Sequence[int]]:
    """`rows` as the model sees them: wrapped by the template, or unchanged without one."""
    return template.wrap_all(rows, max_length) if template else rows
