"""Each concern has one owner (docs/architecture.md, "Who owns what"); these rules keep it so.

The round: the loop (``server_app.loop``) runs it, as Flower's ``Strategy.start`` does. It admits
nodes before each phase, so building messages (``configure_*``) needs no network: only the
setup (``start``), the admission (``admit``) and the node registry's handshakes talk to the
grid. It builds each round's record from the round's plan; no strategy writes one.

The privacy budget: the strategies and the loop see the run's ``RunBudget`` (plan, admit, a
node's local sigma, would-exceed, spend, the ledger entry, the audit's inputs, the server's noised
release); the planner behind it is the budget's own.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fedvlm"


def _functions_loading(name: str, folder: Path, root: Path = PACKAGE) -> set[tuple[str, str]]:
    """(file relative to ``root``, function) for every function under ``folder`` that reads ``name``."""
    found = set()
    for path in sorted(folder.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) for n in ast.walk(fn)):
                found.add((str(path.relative_to(root)), fn.name))
    return found


def test_only_the_setup_the_admission_and_the_registry_talk_to_the_grid():
    users = _functions_loading("grid", PACKAGE / "strategies")
    assert users == {
        ("strategies/base.py", "start"),
        ("strategies/base.py", "admit"),
        ("strategies/nodes.py", "handshake"),
        ("strategies/nodes.py", "wait"),
        ("strategies/nodes.py", "refresh"),
    }


def test_the_rule_sees_a_configure_hook_that_uses_the_grid(tmp_path):
    (tmp_path / "s.py").write_text("def configure_train(self, rnd, arrays, config, grid):\n    grid.get_node_ids()\n")
    assert _functions_loading("grid", tmp_path, tmp_path) == {("s.py", "configure_train")}


def test_only_the_loop_builds_a_round_record():
    users = set()
    for path in PACKAGE.rglob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            named = isinstance(n, ast.Name) and n.id == "RoundRecord"
            imported = isinstance(n, ast.ImportFrom) and any(a.name == "RoundRecord" for a in n.names)
            if named or imported:
                users.add(str(path.relative_to(PACKAGE)))
    assert users == {"strategies/records.py", "server_app/loop.py"}  # where it is defined, and its one user


def _attribute_users(attr: str, root: Path) -> set[str]:
    users = set()
    for path in root.rglob("*.py"):
        if any(isinstance(n, ast.Attribute) and n.attr == attr for n in ast.walk(ast.parse(path.read_text()))):
            users.add(str(path.relative_to(root)))
    return users


def test_only_the_privacy_package_reaches_into_the_planner():
    assert {u for u in _attribute_users("planner", PACKAGE) if not u.startswith("privacy/")} == set()


def test_the_planner_rule_sees_a_reach_in(tmp_path):
    (tmp_path / "s.py").write_text("sigma = strategy.budget.planner.global_plan.sigma\n")
    assert _attribute_users("planner", tmp_path) == {"s.py"}
