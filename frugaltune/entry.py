"""A stage's entry point: every stage module ends with

    def main() -> None:
        stage_main("<stage>", run, <the errors its bad inputs raise>...)

Library code, run by `python -m stages.<name>` (DVC's `cmd`). The stages whose entry point does more (probe's message,
train's re-execution under torchrun, compare's argument) call `faults.stage_errors` themselves.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from frugaltune.config import Params, ParamsError, load_params
from frugaltune.faults import stage_errors


def stage_main(stage: str, run: Callable[[Params], None], *expected: type[Exception]) -> None:
    """A stage's `main()`: `run(params)` inside stage_errors, with params.yaml read and checked first; a bad key, or
    an error of the kinds the stage `expected` (bad input: each names its file, row or key and the fix), becomes one
    line, `<stage>: <message>`, and exit status 1."""
    with stage_errors(stage):
        try:
            run(load_params())
        except (ParamsError, *expected) as exc:
            sys.exit(f"{stage}: {exc}")
