"""`python -m frugaltune.planner --calibration-worker`: the calibration's process (frugaltune.planner.worker
starts it; frugaltune.planner.measure runs its steps). Internal: a person plans with `frugaltune plan` or
`dvc repro plan`.
"""

from __future__ import annotations

import sys

from frugaltune.planner.measure import _worker_main


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--calibration-worker"]:
        _worker_main()
        return
    sys.exit("usage: frugaltune plan   (this module's own entry point is internal: --calibration-worker)")


if __name__ == "__main__":
    main()
