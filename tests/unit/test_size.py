"""The package's size rules (docs/development.md): no function longer than 60 lines, so that each
reads on one screen and a feature is added by a new function, not a longer one."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fedvlm"
MOST = 60


def long_functions(root: Path, most: int = MOST) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                length = node.end_lineno - node.lineno + 1
                if length > most:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_is_over_60_lines():
    assert long_functions(PACKAGE) == []


def test_the_rule_counts_a_function_from_its_def_to_its_last_line(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    (tmp_path / "a.py").write_text(f'def short():\n{body}\n\n\nasync def long():\n    """doc"""\n{body}\n')
    assert long_functions(tmp_path) == ["a.py:63 long (61 lines)"]  # short: 60 lines, allowed
