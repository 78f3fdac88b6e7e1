"""Benchmarks: scripts run as `python benchmarks/<name>.py` (see each one's docstring); a package only so that
import-linter can check that they import the library alone."""
