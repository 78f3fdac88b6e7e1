"""Prefect orchestration of the same stage functions (see DESIGN.md §6)."""
