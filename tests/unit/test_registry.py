"""The method registry is the one place a method is defined (fedvlm/methods/registry.py)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from fedvlm.methods.registry import FAMILIES, METHODS
from fedvlm.methods.validation import validate
from fedvlm.runconfig import ConfigError
from fedvlm.spec import spec_of

PACKAGE = Path(__file__).resolve().parents[2] / "fedvlm"
NAMES = set(METHODS) | set(FAMILIES)


def _constants(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_no_module_outside_the_registry_compares_method_or_family_names():
    """Every ``==``, ``!=``, ``in``, ``not in`` in the package whose operands hold a method or
    family name, and every ``match`` on one: only the registry may dispatch on names."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "methods" / "registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                hits = _constants(node) & NAMES
            elif isinstance(node, ast.match_case):
                hits = _constants(node.pattern) & NAMES
            else:
                continue
            if hits:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {sorted(hits)}")
    assert not found, "method/family names compared outside the registry:\n" + "\n".join(found)


def test_the_source_check_catches_a_comparison(tmp_path):
    """The check above is not vacuous: the pattern it looks for is what such code looks like."""
    tree = ast.parse('if spec.name in ("dpfpl", "fedpgp"):\n    pass\nif family == "vlm":\n    pass\n')
    hits = [_constants(n) & NAMES for n in ast.walk(tree) if isinstance(n, ast.Compare)]
    assert hits == [{"dpfpl", "fedpgp"}, {"vlm"}]


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_entry_names_real_classes_and_a_family(name):
    from fedvlm.strategies.base import FederatedStrategy

    spec = METHODS[name]
    assert isinstance(spec.client, type)
    assert isinstance(spec.strategy, type) and issubclass(spec.strategy, FederatedStrategy), spec.server
    assert FAMILIES[spec.family.name] is spec.family
    cfg = validate({"method": name})
    assert spec_of(cfg) is spec


def test_a_config_carrying_no_method_spec_is_refused_not_read_blind():
    # RunConfig holds its spec as ``object`` (it sits below spec.py); spec_of is the typed door
    cfg = validate({"method": "promptfl"})
    with pytest.raises(TypeError, match="MethodSpec belongs.*validate"):
        spec_of(dataclasses.replace(cfg, spec={"name": "promptfl"}))


def test_fedpgp_has_its_own_rank_key():
    assert validate({"method": "fedpgp", "fedpgp.rank": 2, "dpfpl.rank": 8}).fedpgp.rank == 2
    with pytest.raises(ConfigError, match=r"'fedpgp.rank' = 20 exceeds the 16 context tokens"):
        validate({"method": "fedpgp", "fedpgp.rank": 20})
    with pytest.raises(ConfigError, match=r"'fedpgp.rank' = 0: must be >= 1"):
        validate({"method": "fedpgp", "fedpgp.rank": 0})
    validate({"method": "dpfpl", "dpfpl.rank": 0})  # DP-FPL's full-rank variant


@pytest.mark.parametrize(
    "raw,steps",
    [
        ({"method": "promptfl"}, 0),  # full local epochs, PromptFL's own setting
        ({"method": "promptfl", "privacy.epsilon": 1.0}, 1),  # under DP, as DP-FPL's baselines: one step a round
        ({"method": "promptfl", "privacy.epsilon": 1.0, "prompt.local-steps": 5}, 5),  # an explicit choice stands
        ({"method": "dpfpl"}, 1),
    ],
)
def test_the_method_decides_its_local_steps_with_and_without_privacy(raw, steps):
    assert validate(raw).prompt.local_steps == steps
