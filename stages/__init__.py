"""The DVC stages: one module per stage, each run as `python -m stages.<name>`."""
