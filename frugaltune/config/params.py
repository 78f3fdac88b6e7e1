"""`Params`: the whole params file, one field per section, `auto` values resolved and the sections checked
against each other.

Library code, no entry point: imported through `frugaltune.config`.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, model_validator

from frugaltune.config.base import AUTO, Section, derived_input_template, derived_model_name
from frugaltune.config.data import CommonParams, DataParams, ModelParams, TaskParams, TokenizeParams, ValidateParams
from frugaltune.config.federated import FederatedParams
from frugaltune.config.release import RegisterParams, ScheduleParams
from frugaltune.config.scheduling import SchedulingParams
from frugaltune.config.training import CompareParams, EvaluateParams, KernelsParams, ProbeParams, TrainParams


class Params(Section):
    common: CommonParams = Field(default_factory=CommonParams)
    model: ModelParams = Field(default_factory=ModelParams)
    task: TaskParams = Field(default_factory=TaskParams)
    data: DataParams = Field(default_factory=DataParams)
    validate_: ValidateParams = Field(default_factory=ValidateParams, alias="validate")
    tokenize: TokenizeParams = Field(default_factory=TokenizeParams)
    probe: ProbeParams = Field(default_factory=ProbeParams)
    kernels: KernelsParams = Field(default_factory=KernelsParams)
    train: TrainParams = Field(default_factory=TrainParams)
    evaluate: EvaluateParams = Field(default_factory=EvaluateParams)
    compare: CompareParams = Field(default_factory=CompareParams)
    register_: RegisterParams = Field(default_factory=RegisterParams, alias="register")
    schedule: ScheduleParams = Field(default_factory=ScheduleParams)
    scheduling: SchedulingParams = Field(default_factory=SchedulingParams)
    federated: FederatedParams = Field(default_factory=FederatedParams)

    # `validate` and `register` shadow BaseModel attributes, hence the trailing underscore in code; the YAML keys
    # are the plain names.
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _resolve_auto(cls, raw: Any) -> Any:
        """`auto` in train.input_template and register.model_name becomes its value for this data and task, so
        every reader (train, plan, federated, register, predict) sees the one resolved value."""
        if not isinstance(raw, dict):
            return raw

        def section(key: str) -> dict:
            value = raw.get(key)
            return value if isinstance(value, dict) else {}

        data, task, train, register = (section(key) for key in ("data", "task", "train", "register"))
        resolved = dict(raw)
        if train.get("input_template") == AUTO:
            label_column = data.get("label_column", DataParams.model_fields["label_column"].default)
            resolved["train"] = {**train, "input_template": derived_input_template(str(label_column))}
        if register.get("model_name", AUTO) == AUTO:
            source = data.get("source", DataParams.model_fields["source"].default)
            task_type = task.get("type", TaskParams.model_fields["type"].default)
            resolved["register"] = {**register, "model_name": derived_model_name(str(source), str(task_type))}
        return resolved

    @model_validator(mode="after")
    def _check_split_shares(self) -> "Params":
        if self.data.split.val + self.data.split.test >= 0.9:
            raise ValueError(
                f"data.split: val ({self.data.split.val}) + test ({self.data.split.test}) leave under 10% for "
                "training. Lower them."
            )
        return self
