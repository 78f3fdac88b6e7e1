"""What the README's commands write into the checkout stays out of git: `git check-ignore` on the paths they name.

    pytest tests/unit/test_gitignore.py
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_readmes_merged_export_is_ignored_by_git():
    """Issue 94: `frugaltune export --merged models/merged` left 538 MB of untracked files for `git add .` to take."""
    if subprocess.run(["git", "rev-parse", "--git-dir"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip(f"{ROOT} is not a git checkout")
    exported = set(re.findall(r"--merged (\S+)", (ROOT / "README.md").read_text(encoding="utf-8")))
    assert "models/merged" in exported
    for folder in exported:
        for name in ("model.safetensors", "config.json", "tokenizer.json"):
            path = f"{folder.rstrip('/')}/{name}"
            ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT)
            assert ignored.returncode == 0, f"{path} is not ignored by git"
