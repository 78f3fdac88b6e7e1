"""The shell commands of README.md's ```bash blocks, for the tests that run them (tests/e2e/test_readme.py, and
tests/e2e/test_prefect.py for the Prefect ones). Imported by those tests; not run on its own."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def commands(readme: Path = README) -> list[str]:
    """Every command line of every ```bash block, without its trailing comment, in README order."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", readme.read_text(encoding="utf-8"), re.S):
        for line in block.splitlines():
            command = re.sub(r"\s+#.*$", "", line).strip()
            if command and not command.startswith("#"):
                found.append(command)
    return found


def bare(command: str) -> str:
    """The command without its leading VAR=value assignments and `.venv/bin/`: what it runs."""
    return re.sub(r"^(\w+=\S+\s+)*(\.venv/bin/)?", "", command)


def command(prefix: str) -> str:
    """The one README command that starts with `prefix` (after any VAR=value assignments)."""
    hits = [c for c in commands() if bare(c).startswith(prefix)]
    assert len(hits) == 1, f"README.md: expected one command starting with {prefix!r}, found {hits}"
    return hits[0]
