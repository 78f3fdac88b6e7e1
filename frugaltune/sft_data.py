"""Synthetic prompt -> response data, built offline: for the generative demo, its tests and your first try.

    python -m frugaltune.sft_data dates data/dates.jsonl --rows 400 [--seed 0] [--candidates 4]
    python -m frugaltune.sft_data arithmetic data/arithmetic.jsonl --rows 400 [--seed 0] [--candidates 4]
    python -m frugaltune.sft_data chat data/chat.jsonl --rows 200

`dates` (the README's example): a date as people write it -> ISO 8601, "Write this date as YYYY-MM-DD: the 3rd of
March, 2024" -> "2024-03-03", in eight styles (weekday, ordinal, abbreviated month, day first, dotted). A format to
learn, which a small base model can: it copies the digits and maps twelve month names. `arithmetic`: "What is 37 + 58?" -> "95" (sums, differences, products of small numbers, and unit conversions such as
"How many minutes are in 3 hours?" -> "180"), one JSON object per line with `prompt` and `response`; with
`--candidates K`, a `candidates` list of K answers (the right one among K-1 near misses) for constrained choice.
`chat`: the same questions as chat `messages` ([user, assistant]), for `task.messages_column: messages`.
Deterministic for a seed; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import calendar
import datetime
import json
import random
from pathlib import Path

UNITS = (("minutes", "hours", 60), ("seconds", "minutes", 60), ("hours", "days", 24), ("days", "weeks", 7),
         ("centimetres", "metres", 100), ("grams", "kilograms", 1000), ("months", "years", 12))


def arithmetic_pair(rng: random.Random) -> tuple[str, int]:
    """One question and its integer answer."""
    kind = rng.choice(("add", "sub", "mul", "unit"))
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    if kind == "add":
        return f"What is {a} + {b}?", a + b
    if kind == "sub":
        a, b = max(a, b), min(a, b)
        return f"What is {a} - {b}?", a - b
    if kind == "mul":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return f"What is {a} times {b}?", a * b
    small, large, factor = rng.choice(UNITS)
    n = rng.randint(2, 9)
    return f"How many {small} are in {n} {large}?", n * factor


DATE_INSTRUCTION = "Write this date as YYYY-MM-DD: "


def _ordinal(day: int) -> str:
    suffix = "th" if 10 <= day % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day}{suffix}"


# How the date is written in the prompt; the answer is always date.isoformat()
DATE_STYLES = (
    lambda d: f"{calendar.month_name[d.month]} {d.day}, {d.year}",
    lambda d: f"{d.day} {calendar.month_name[d.month]} {d.year}",
    lambda d: f"{calendar.month_abbr[d.month]} {d.day}, {d.year}",
    lambda d: f"{_ordinal(d.day)} {calendar.month_name[d.month]} {d.year}",
    lambda d: f"the {_ordinal(d.day)} of {calendar.month_name[d.month]}, {d.year}",
    lambda d: f"{calendar.day_name[d.weekday()]}, {calendar.month_name[d.month]} {d.day}, {d.year}",
    lambda d: f"{calendar.month_name[d.month]} {_ordinal(d.day)} {d.year}",
    lambda d: f"{d.day:02d}.{d.month:02d}.{d.year}",
)


def date_pair(rng: random.Random) -> tuple[str, str]:
    """One date as written by someone, and its ISO 8601 form."""
    year, month = rng.randint(1950, 2049), rng.randint(1, 12)
    day = rng.randint(1, calendar.monthrange(year, month)[1])
    date = datetime.date(year, month, day)
    return DATE_INSTRUCTION + rng.choice(DATE_STYLES)(date), date.isoformat()


def date_near_misses(answer: str, k: int, rng: random.Random) -> list[str]:
    """`answer` and k-1 valid dates one slip away (a day, a month or a year off; day and month swapped)."""
    year, month, day = (int(part) for part in answer.split("-"))
    slips = [(year, month, day + 1), (year, month, day - 1), (year, month + 1, day), (year, month - 1, day),
             (year + 1, month, day), (year - 1, month, day), (year, day, month)]
    options = [answer]
    for y, m, d in rng.sample(slips, len(slips)):
        try:
            iso = datetime.date(y, m, d).isoformat()
        except ValueError:  # no 31st of that month, no 13th month
            continue
        if iso not in options:
            options.append(iso)
    listed = options[:k]
    rng.shuffle(listed)
    return listed


def near_misses(answer: int, k: int, rng: random.Random) -> list[str]:
    """`answer` and k-1 other plausible integers, shuffled."""
    options = {answer}
    while len(options) < k:
        options.add(max(0, answer + rng.choice((-10, -2, -1, 1, 2, 10, answer or 1))))
    listed = [str(o) for o in options]
    rng.shuffle(listed)
    return listed


def _distinct_rows(pair, misses, rows: int, seed: int, candidates: int) -> list[dict]:
    """`rows` rows of distinct prompts from `pair(rng)`, with `misses(answer, k, rng)` as candidates when asked."""
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < rows:
        prompt, answer = pair(rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        row = {"prompt": prompt, "response": str(answer)}
        if candidates:
            row["candidates"] = misses(answer, candidates, rng)
        out.append(row)
    return out


def arithmetic_rows(rows: int, seed: int = 0, candidates: int = 0) -> list[dict]:
    """`rows` distinct questions (prompt, response[, candidates])."""
    return _distinct_rows(arithmetic_pair, near_misses, rows, seed, candidates)


def date_rows(rows: int, seed: int = 0, candidates: int = 0) -> list[dict]:
    """`rows` distinct dates to rewrite (prompt, response[, candidates])."""
    return _distinct_rows(date_pair, date_near_misses, rows, seed, candidates)


def chat_rows(rows: int, seed: int = 0) -> list[dict]:
    return [{"messages": [{"role": "user", "content": row["prompt"]},
                          {"role": "assistant", "content": row["response"]}]} for row in arithmetic_rows(rows, seed)]


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m frugaltune.sft_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("dates", "arithmetic", "chat"))
    parser.add_argument("out", type=Path, help="the .jsonl file to write")
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--candidates", type=int, default=0, help="dates, arithmetic: K allowed answers per row (0: none)")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.candidates == 1 or args.candidates < 0:
        parser.error("--rows must be >= 1 and --candidates 0 or >= 2")
    build = {"dates": date_rows, "arithmetic": arithmetic_rows}.get(args.kind)
    rows = build(args.rows, args.seed, args.candidates) if build else chat_rows(args.rows, args.seed)
    print(f"wrote {len(rows)} rows to {write_jsonl(rows, args.out)}")


if __name__ == "__main__":
    main()
