"""Typed `params.yaml`: one pydantic model per section, unknown keys rejected before any compute.

Not run directly; every stage calls `load_params()`. To check a params file by hand:

    python -m frugaltune.config [params.yaml]

A misspelled key fails with its path and a suggestion (`train.lora.rnk: unknown key. Did you mean
`train.lora.r`?`), a wrong type names the key, the value and the expected type, and a file the params name
(`scheduling.trace`, relative to the params file's directory) must exist. The check by hand (which `make pipeline`
and `make schedule` run before `dvc repro`) also refuses a damaged dvc.lock beside the file and a checkout that
cannot be written (frugaltune.checkout).

The schema lives in the modules of this package, each name re-exported here (import from `frugaltune.config`),
and each module imports only the ones below it (an import-linter `layers` contract, pyproject.toml): `__main__`;
`loading` (load_params, parse_params, ParamsError, the check by hand); `params` (Params, the whole file);
`federated`, `release` (register, schedule) and `scheduling` (the scheduling pipeline's sections, its trace);
`data` (common, model, task, data, validate, tokenize) and `training` (probe, kernels, train and its methods,
compare, evaluate); `base` (Section, the name/alias/label rules, `auto` values).
"""

from __future__ import annotations

from frugaltune.config.base import (
    ALIAS_RULE,
    AUTO,
    BUILTIN_DATA_NAMES,
    MAX_LABEL_CHARS,
    NAME_RULE,
    Section,
    check_alias,
    check_name,
    derived_input_template,
    derived_model_name,
    label_problem,
)
from frugaltune.config.data import (
    CommonParams,
    DataParams,
    ModelParams,
    SplitParams,
    TaskParams,
    TokenizeParams,
    ValidateParams,
)
from frugaltune.config.training import (
    CompareParams,
    DistributedParams,
    EvaluateParams,
    FullParams,
    KernelsParams,
    LoraParams,
    NoneParams,
    PrelayerParams,
    ProbeParams,
    QloraParams,
    TrainParams,
)
from frugaltune.config.release import RegisterParams, ScheduleParams
from frugaltune.config.scheduling import (
    DEFAULT_TRACE,
    DEFAULT_TRACE_SHA256,
    SchedulingEvaluationParams,
    SchedulingLlmParams,
    SchedulingParams,
    SchedulingSecondWorkloadParams,
    SchedulingSftParams,
    SchedulingUsersParams,
    SchedulingUserWorkloadParams,
    SchedulingValidateParams,
    trace_file,
)
from frugaltune.config.federated import FederatedDpParams, FederatedParams
from frugaltune.config.params import Params
from frugaltune.config.loading import DuplicateKeyError, ParamsError, load_params, main, parse_params

__all__ = [
    "ALIAS_RULE",
    "AUTO",
    "BUILTIN_DATA_NAMES",
    "MAX_LABEL_CHARS",
    "NAME_RULE",
    "Section",
    "check_alias",
    "check_name",
    "derived_input_template",
    "derived_model_name",
    "label_problem",
    "CommonParams",
    "DataParams",
    "ModelParams",
    "SplitParams",
    "TaskParams",
    "TokenizeParams",
    "ValidateParams",
    "CompareParams",
    "DistributedParams",
    "EvaluateParams",
    "FullParams",
    "KernelsParams",
    "LoraParams",
    "NoneParams",
    "PrelayerParams",
    "ProbeParams",
    "QloraParams",
    "TrainParams",
    "RegisterParams",
    "ScheduleParams",
    "DEFAULT_TRACE",
    "DEFAULT_TRACE_SHA256",
    "SchedulingEvaluationParams",
    "SchedulingLlmParams",
    "SchedulingParams",
    "SchedulingSecondWorkloadParams",
    "SchedulingSftParams",
    "SchedulingUsersParams",
    "SchedulingUserWorkloadParams",
    "SchedulingValidateParams",
    "trace_file",
    "FederatedDpParams",
    "FederatedParams",
    "Params",
    "DuplicateKeyError",
    "ParamsError",
    "load_params",
    "main",
    "parse_params",
]
