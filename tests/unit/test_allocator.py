"""The training process's malloc (frugaltune/allocator.py): preloading, re-executing once, falling back.

Run with `make test-fast` (or `pytest tests/unit/test_allocator.py`). Real processes: each check starts Python.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from frugaltune import allocator

needs_mimalloc = pytest.mark.skipif(allocator.mimalloc_library() is None,
                                    reason="cmeel-mimalloc not installed (a Linux-only dependency)")


def _active_in_child(env: dict) -> str:
    code = "from frugaltune import allocator; print(allocator.active())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


@needs_mimalloc
def test_child_env_preloads_mimalloc_with_purging_off_and_system_removes_it():
    env = allocator.child_env("auto")
    assert env["MIMALLOC_PURGE_DELAY"] == "-1"
    assert _active_in_child(env) == "mimalloc"
    # "system" strips an inherited preload but keeps the user's other preloaded libraries
    inherited = {**env, "LD_PRELOAD": f"{allocator.mimalloc_library()}:/nonexistent/libother.so"}
    system = allocator.child_env("system", inherited)
    assert system["LD_PRELOAD"] == "/nonexistent/libother.so"
    assert _active_in_child({**system, "LD_PRELOAD": ""}) == "system"


@needs_mimalloc
def test_reexec_switches_the_running_process_once_keeping_pid_and_argv(tmp_path):
    script = tmp_path / "entry.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        from frugaltune import allocator
        print(json.dumps({"pid": os.getpid(), "before": allocator.active(), "argv": sys.argv[1:]}), flush=True)
        got = allocator.reexec_with(sys.argv[1])
        print(json.dumps({"pid": os.getpid(), "after": got, "mark": "FRUGALTUNE_ALLOCATOR_REEXEC" in os.environ}))
    """))
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, str(script), "auto", "--flag"], env=env, capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()
    first, second, final = (json.loads(line) for line in out)
    assert first["before"] == "system" and second["before"] == "mimalloc"
    assert first["pid"] == second["pid"] == final["pid"]  # exec, not a child process
    assert second["argv"] == ["auto", "--flag"]
    assert final["after"] == "mimalloc" and final["mark"] is False  # children of the stage decide for themselves
    # and back: `system` asked for in a process that inherited mimalloc
    env["LD_PRELOAD"] = str(allocator.mimalloc_library())
    out = subprocess.run([sys.executable, str(script), "system"], env=env, capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()
    assert json.loads(out[-1])["after"] == "system"


def test_every_training_process_bounds_onednns_shape_caches_unless_the_user_set_them(tmp_path):
    """A child (the calibration, the federation's processes) gets the bounds in its environment; a process that
    needs no re-exec sets them in its own before torch's first product; a value the user exported wins."""
    env = allocator.child_env("system", {"PATH": os.environ.get("PATH", "")})
    assert {k: env[k] for k in allocator.PROCESS_ENV} == allocator.PROCESS_ENV == {
        "LRU_CACHE_CAPACITY": "1", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128"}
    assert allocator.child_env("auto", {"LRU_CACHE_CAPACITY": "1024"})["LRU_CACHE_CAPACITY"] == "1024"
    script = tmp_path / "entry.py"
    script.write_text("import json, os\nfrom frugaltune import allocator\nallocator.reexec_with('system')\n"
                      "print(json.dumps({k: os.environ.get(k) for k in allocator.PROCESS_ENV}))\n")
    base = {k: v for k, v in os.environ.items() if k not in allocator.PROCESS_ENV and k != "LD_PRELOAD"}
    run = lambda env: json.loads(subprocess.run([sys.executable, str(script)], env=env, capture_output=True,  # noqa: E731
                                                text=True, check=True).stdout)
    assert run(base) == allocator.PROCESS_ENV
    assert run({**base, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"})["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "0"


def test_mimalloc_asked_for_but_missing_says_how_to_fix(monkeypatch):
    monkeypatch.setattr(allocator, "mimalloc_library", lambda: None)
    assert allocator.resolve("auto") == "system"  # auto falls back quietly
    with pytest.raises(ValueError, match="pip install cmeel-mimalloc.*train.allocator: auto"):
        allocator.resolve("mimalloc")
    with pytest.raises(ValueError, match="not one of auto, mimalloc, system"):
        allocator.resolve("jemalloc")


def test_a_failed_reexec_is_not_retried(monkeypatch):
    # the mark says this process was already re-executed: whatever it has, it keeps (no exec loop)
    monkeypatch.setenv("FRUGALTUNE_ALLOCATOR_REEXEC", "1")
    monkeypatch.setattr(allocator.os, "execve", lambda *a: pytest.fail("exec attempted twice"))
    assert allocator.reexec_with("auto") == allocator.active()
    assert "FRUGALTUNE_ALLOCATOR_REEXEC" not in os.environ


@needs_mimalloc
def test_every_process_of_a_local_federation_gets_the_allocator_asked_for(tmp_path, monkeypatch):
    from frugaltune.federated.launch import LocalFederation

    fed = LocalFederation(tmp_path / "bin", tmp_path / "work", [], tmp_path, allocator="auto")
    assert str(allocator.mimalloc_library()) in fed.env()["LD_PRELOAD"]
    assert fed.env()["MIMALLOC_PURGE_DELAY"] == "-1"
    monkeypatch.setenv("LD_PRELOAD", str(allocator.mimalloc_library()))  # the caller runs on mimalloc
    fed.allocator = "system"  # the default: the preload it inherits is removed
    assert "libmimalloc" not in fed.env().get("LD_PRELOAD", "")
