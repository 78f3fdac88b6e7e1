"""Params sections of what follows an evaluation: `register` (the MLflow registry's model name, alias and
deciding metric) and `schedule` (when and how the Prefect flow runs the pipeline).

Library code, no entry point: imported through `frugaltune.config`.
"""

from __future__ import annotations

import difflib

from pydantic import Field, field_validator

from frugaltune.config.base import AUTO, Section, check_alias, check_name


class RegisterParams(Section):
    model_name: str = Field(
        AUTO, description="Name in the MLflow model registry. `auto` = frugaltune-<the data's name>: the file's "
        "(or directory's) stem of data.source, `sentiment` for the built-in tweets, and `-sft` after it for "
        "causal_lm, so that another task or data set never becomes a version of another's model. A name is 1-100 "
        "letters, digits, `.`, `_` or `-` (NAME_RULE), checked before any compute.")
    alias: str = Field("champion", description="Alias that moves to a new version only when it beats the holder "
                       "(letters, digits, `_`, `-`; not `latest` or `v<n>`).")
    metric: str = Field("macro_f1", description="Metric in reports/evaluate.json (`finetuned.<metric>`) that decides.")
    higher_is_better: bool = Field(
        True, description="Direction of `metric`: true for accuracy/F1, false for a loss. Ties never move the alias."
    )

    @field_validator("model_name")
    @classmethod
    def _model_name_is_a_name(cls, name: str) -> str:
        return check_name(name)

    @field_validator("alias")
    @classmethod
    def _alias_is_an_alias(cls, alias: str) -> str:
        return check_alias(alias)


class ScheduleParams(Section):
    """Read only by the Prefect flow (flows/), never by a DVC stage: changing it reruns nothing."""

    cron: str = Field(
        "0 3 * * *",
        description="When `make serve` starts the `finetune` flow, in cron syntax (minute hour day-of-month month "
        "day-of-week) read in `schedule.timezone`. A run that finds no new data and no changed params finishes in "
        "seconds and registers nothing.",
    )
    timezone: str = Field("UTC", description="IANA time zone of `schedule.cron`, e.g. `Europe/Paris`.")
    stage_timeout_s: int = Field(
        3600, ge=1, description="A flow run stops a stage that runs longer than this and fails (train: train_timeout_s)."
    )
    train_timeout_s: int = Field(43200, ge=1, description="The same limit for the train stage.")
    register_retries: int = Field(
        3, ge=0, description="Retries of the register stage after a failure (MLflow registry writes can fail "
        "transiently; the stage is idempotent, so a retry never adds a second version)."
    )
    retry_delay_s: float = Field(30, ge=0, description="Seconds between those retries.")

    @field_validator("cron")
    @classmethod
    def _check_cron(cls, value: str) -> str:
        if len(value.split()) != 5:
            raise ValueError(
                "expected 5 fields (minute hour day-of-month month day-of-week), e.g. '0 3 * * *' for 03:00 daily"
            )
        return value

    @field_validator("timezone")
    @classmethod
    def _check_timezone(cls, value: str) -> str:
        import zoneinfo

        try:
            zoneinfo.ZoneInfo(value)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            close = difflib.get_close_matches(value, sorted(zoneinfo.available_timezones()), n=1)
            raise ValueError(
                "not an IANA time zone " + (f"(did you mean '{close[0]}'?)" if close else "(e.g. UTC, Europe/Paris)")
            ) from None
        return value
