"""The planner: will a training run fit, and how long will it take? Answered before any weight is loaded.

Library code. The `plan` stage (`python -m stages.plan`) and `frugaltune plan` run it through
`frugaltune.planner.assembly.build_plan`; `python -m frugaltune.planner --calibration-worker` is the calibration's
own process (internal). Its rooms, each importing only those above it:

- memory: a model's exact shapes, the memory and time model, the run's batches;
- machine: the machine decisions (precision, attention crossover, threads, int8 products, the memory limit);
- measure: what the calibration's process runs (the train loop's steps timed, the bytes saved for backward);
- worker: that process as the planner sees it (started early, watched, stopped);
- calibration: the run's micro-batches picked, timed in that process and fitted (`calibrate` -> `Calibration`);
- recalibration: the plan's calibration at its pick, and again where the measured memory moves the pick;
- assembly: the plan (every method priced, the fit check, `build_plan`);
- render: the plan as a table.
"""
