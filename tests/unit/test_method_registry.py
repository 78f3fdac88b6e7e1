"""The method registry (frugaltune/methods.py): every method's facts in one place, every list of methods built from
it, one shape of LoRA settings, and no branch on a method's name anywhere else in the library or the stages.
Run with `pytest tests/unit/test_method_registry.py` (no model, under a second)."""

from __future__ import annotations

import argparse
import ast
import typing
from pathlib import Path

import pytest
import yaml

from frugaltune import methods
from frugaltune.cli import build_parser
from frugaltune.config import parse_params
from frugaltune.config.training import CompareParams, LoraParams, QloraParams, TrainParams
from frugaltune.federated.settings import RunSettings
from frugaltune.planner.assembly import method_knobs

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = ROOT / "frugaltune" / "methods.py"
# The method-name branches allowed outside the registry, as (file, the line's code): at most five, each with why.
# None is left; a new one needs a fact in the registry instead (docs/METHODS.md, "Adding a method").
ALLOWED: set[tuple[str, str]] = set()


def _names_a_method(node: ast.AST) -> bool:
    """A method's name as a literal (alone or in a literal tuple/list/set), or a list of methods kept by name
    (`METHODS`, `*_METHODS`, `TIMING_ORDER`: the constants the registry replaced)."""
    if isinstance(node, ast.Constant):
        return node.value in methods.NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(isinstance(e, ast.Constant) and e.value in methods.NAMES for e in node.elts)
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name == "METHODS" or name.endswith("_METHODS") or name == "TIMING_ORDER"


def method_name_branches(source: str) -> list[int]:
    """Lines that branch on a method's name: `==`, `!=`, `in`, `not in` against a name (or a list of names), and
    dict literals keyed by two or more names (a table by method, e.g. FLOPs or learning rates by name)."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            if (any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops)
                    and any(_names_a_method(operand) for operand in (node.left, *node.comparators))):
                lines.add(node.lineno)
        elif isinstance(node, ast.Dict):
            if sum(isinstance(k, ast.Constant) and k.value in methods.NAMES for k in node.keys) >= 2:
                lines.add(node.lineno)
    return sorted(lines)


def test_the_scan_finds_the_branches_it_is_meant_to_find():
    """The scan itself: each form the registry replaced is found, and what is not a branch on a name is not."""
    found = method_name_branches(
        'if method == "none": pass\n'
        'x = method in ("lora", "dora")\n'
        'y = method not in PEFT_METHODS\n'
        'z = {"full": 6.0, "lora": 4.0}\n'
        'w = spec.trained and method != calibrated\n'
        'v = {"lora": params}\n'
        'for m in ("lora", "qlora"): pass\n')
    assert found == [1, 2, 3, 4]


def test_no_method_name_branches_outside_the_registry():
    """Issue 91: at most five, listed in ALLOWED. A new method is a registry entry, not a branch in each consumer."""
    assert len(ALLOWED) <= 5
    found = set()
    for path in sorted([*(ROOT / "frugaltune").rglob("*.py"), *(ROOT / "stages").rglob("*.py")]):
        if path == REGISTRY:
            continue
        source = path.read_text()
        lines = source.splitlines()
        found |= {(str(path.relative_to(ROOT)), lines[n - 1].strip()) for n in method_name_branches(source)}
    assert found <= ALLOWED, "branches on a method's name outside frugaltune/methods.py (read a fact of " \
        f"methods.get(name) instead): {sorted(found - ALLOWED)}"


def test_every_list_of_methods_is_the_registrys():
    """train.method's choices, compare.methods' default, `frugaltune plan --method` and the compare matrix in
    compare/dvc.yaml name the registry's methods, in its order."""
    assert typing.get_args(TrainParams.model_fields["method"].annotation) == methods.NAMES
    assert tuple(CompareParams().methods) == methods.NAMES
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    option = next(a for a in commands.choices["plan"]._actions if "--method" in a.option_strings)
    assert tuple(option.choices) == methods.NAMES
    matrix = yaml.safe_load((ROOT / "compare" / "dvc.yaml").read_text())["stages"]["compare"]["matrix"]["method"]
    assert tuple(matrix) == methods.NAMES


@pytest.mark.parametrize("name", methods.NAMES)
def test_each_method_has_the_params_section_its_facts_need(name):
    """`train.<name>` exists for every method: a LoRA section for one with adapters (a QLoRA one for a 4-bit
    base), an `lr` for one with its own learning rate."""
    method = methods.get(name)
    section = TrainParams.model_fields[name].annotation
    assert issubclass(section, LoraParams) == method.adapters
    assert issubclass(section, QloraParams) == (method.adapters and method.quantized_base)
    assert ("lr" in section.model_fields) == method.own_lr
    assert method.trained or method.flops_factor == 2.0  # a method that trains nothing runs forward only


def test_an_unknown_method_is_named_with_the_choices():
    with pytest.raises(ValueError, match="unknown method 'lorra'; methods: none, full, lora, qlora, prelayer, dora"):
        methods.get("lorra")


def test_lora_settings_have_one_shape_from_params_to_the_planner_and_the_federation():
    """train.<method>, the planner's knobs and a federation's global adapter (from params, or from Flower's flat
    run-config keys) are the same MethodKnobs."""
    params = parse_params({"train": {"qlora": {"r": 4, "quant_type": "fp4"}},
                           "federated": {"lora": {"r": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]}}})
    knobs = method_knobs(params)
    assert set(knobs) == {name for name, m in methods.METHODS.items() if m.adapters}
    assert knobs["qlora"] == params.train.knobs(methods.get("qlora")) == methods.MethodKnobs(r=4, quant_type="fp4")
    assert params.train.knobs(methods.get("full")) == methods.MethodKnobs()
    flower = RunSettings(lora_r=16, lora_alpha=32, lora_target_modules=["q_proj", "v_proj"]).lora()
    assert flower == params.federated.lora.knobs() == methods.MethodKnobs(16, 32, 0.05, ("q_proj", "v_proj"))
