"""Issue 46: every run-time change to Flower sits in one table (``deploy.flower_patches``), each
guarded, installed only by the processes that need it, and documented."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import flwr

from fedvlm.deploy import flower_patches
from fedvlm.deploy.flower_patches import PATCHES, TESTED_WITH

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fedvlm"


def test_every_patch_recognises_the_installed_flower():
    """Fails on a Flower upgrade that moved what a patch changes: revisit that patch then."""
    assert {p.name: p.guard() for p in PATCHES} == {p.name: None for p in PATCHES}


def test_the_patches_were_written_for_the_pinned_flower():
    pinned = re.search(r"^flwr==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    assert pinned and pinned.group(1).startswith(TESTED_WITH + ".") and flwr.__version__ == pinned.group(1)


def _installers(root: Path, modules: dict[str, dict[str, str]]) -> dict[str, set[str]]:
    """Patch name -> the files under ``root`` that call one of its installers (``modules``: the
    patch modules by dotted name -> each installer function's patch; a module may hold two)."""
    found: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        calls: dict[str, str] = {}  # a called name -> the patch it installs
        held: dict[str, str] = {}  # a local name of a patch module -> its dotted name
        own = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        if own in modules:  # a patch module calling its own installer
            calls |= modules[own]
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module:
                for a in n.names:
                    if f"{n.module}.{a.name}" in modules:
                        held[a.asname or a.name] = f"{n.module}.{a.name}"
                    elif n.module in modules and a.name in modules[n.module]:
                        calls[a.asname or a.name] = modules[n.module][a.name]
        for n in ast.walk(tree):
            if not isinstance(n, ast.Call):
                continue
            f, patch = n.func, None
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in held:
                patch = modules[held[f.value.id]].get(f.attr)
            elif isinstance(f, ast.Name):
                patch = calls.get(f.id)
            if patch is not None:
                found.setdefault(patch, set()).add(str(path.relative_to(root.parent)))
    return found


def test_only_the_processes_that_need_a_patch_install_it():
    modules: dict[str, dict[str, str]] = {}
    for p in PATCHES:
        modules.setdefault(p.module, {}).update(dict.fromkeys(p.installers, p.name))
    found = _installers(PACKAGE, modules)
    for p in PATCHES:  # a patch's own module may install another (the SuperNode's command installs three)
        assert found.get(p.name, set()) == set(p.installed_by), p.name


def test_the_installer_rule_sees_a_call(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("from fedvlm.deploy import task_claims\ntask_claims.install(1.0)\n")
    lazy = "def f():\n    from fedvlm.deploy.clientapp_forks import install\n    install('x', 'y')\n"
    (pkg / "b.py").write_text(lazy)
    (pkg / "c.py").write_text("from fedvlm.deploy import object_batches\nobject_batches.serve()\n")
    modules = {
        "fedvlm.deploy.task_claims": {"install": "task-claims"},
        "fedvlm.deploy.clientapp_forks": {"install": "clientapp-forks"},
        "fedvlm.deploy.object_batches": {"serve": "batches-served", "install": "batches-sent"},
    }
    found = {"task-claims": {"pkg/a.py"}, "clientapp-forks": {"pkg/b.py"}, "batches-served": {"pkg/c.py"}}
    assert _installers(pkg, modules) == found


def test_every_patch_is_documented_where_an_operator_reads():
    text = (ROOT / "docs" / "deployment.md").read_text()
    assert all(f"`{p.name}`" in text for p in PATCHES)
    words = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
    count = (words + " seventeen eighteen nineteen twenty twenty-one twenty-two").split()[len(PATCHES)]
    assert f"The {count} changes to Flower" in text  # the table's count, said in words, kept true
    assert flower_patches.BY_NAME.keys() == {p.name for p in PATCHES}


def _flower_bound(tree: ast.Module) -> set[str]:
    """Names in a module that hold a Flower module, class, function or runtime object: imported
    from ``flwr`` (also through ``importlib.import_module``), taken from such a name, returned by a
    function of the module that imports from ``flwr`` (unpacked or looped over), a loop variable
    over a tuple holding them, and a parameter called ``grid`` (the ServerApp's, Flower's)."""
    names: set[str] = set()
    paths = {  # module-level constants naming a Flower module (for import_module)
        t.id
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and str(n.value.value).startswith("flwr")
        for t in n.targets
        if isinstance(t, ast.Name)
    }

    def imports_flower(n: ast.AST) -> bool:
        if isinstance(n, ast.ImportFrom):
            return (n.module or "").startswith("flwr")
        if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("import_module") and n.args:
            arg = n.args[0]
            return (isinstance(arg, ast.Constant) and str(arg.value).startswith("flwr")) or (
                isinstance(arg, ast.Name) and arg.id in paths
            )
        return False

    returns_flower = {
        f.name
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef)
        and any(imports_flower(n) for n in ast.walk(f))
        and any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(f))
    }

    def flower(value: ast.AST | None) -> bool:
        if value is None:
            return False
        if isinstance(value, ast.Call):
            return imports_flower(value) or ast.unparse(value.func) in returns_flower
        return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(value))

    def bind(target: ast.AST) -> None:  # a name or a tuple of names, not an attribute's owner
        if isinstance(target, ast.Name):
            names.add(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                bind(t)

    for _ in range(3):  # names taken from names: a few passes reach a fixed point in this package
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                names.update((a.asname or a.name.split(".")[0]) for a in n.names if a.name.startswith("flwr"))
            elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("flwr"):
                names.update(a.asname or a.name for a in n.names)
            elif isinstance(n, ast.Assign) and flower(n.value):
                for t in n.targets:
                    bind(t)
            elif isinstance(n, ast.AnnAssign) and flower(n.value):
                bind(n.target)
            elif isinstance(n, (ast.For, ast.comprehension)) and flower(n.iter):
                bind(n.target)
            elif isinstance(n, ast.arg) and n.arg == "grid":
                names.add("grid")
    return names


def flower_changes(source: str) -> list[str]:
    """Every assignment (``=``, ``+=``, ``setattr``, ``delattr``) to an attribute or item of a
    Flower module, class, function or runtime object in ``source``."""
    tree = ast.parse(source)
    names = _flower_bound(tree)

    def base(node: ast.AST) -> str | None:
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    out = []
    for n in ast.walk(tree):
        targets = (
            n.targets
            if isinstance(n, ast.Assign)
            else [n.target]
            if isinstance(n, ast.AugAssign | ast.AnnAssign)
            else []
        )
        for t in targets:
            if isinstance(t, (ast.Attribute, ast.Subscript)) and base(t) in names:
                out.append(f"{n.lineno}: {ast.unparse(t)}")
        if isinstance(n, ast.Call) and ast.unparse(n.func) in ("setattr", "delattr") and n.args:
            if base(n.args[0]) in names:
                out.append(f"{n.lineno}: {ast.unparse(n)}")
    return out


def test_every_change_to_flower_is_a_row_of_the_table():
    """Whatever its form, a change to Flower's runtime made anywhere in the package is in a module
    the table lists (and so guarded, documented and installed only where the table says)."""
    listed = {p.module for p in PATCHES}
    changes = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found = [c for c in flower_changes(path.read_text()) if module not in listed]
        if found:
            changes[module] = found
    assert changes == {}


def test_the_change_finder_sees_every_form():
    source = """
import importlib
import flwr.supernode.loop as loop
from flwr.serverapp import Grid
from flwr.supercore import constant

def _classes():
    from flwr.state import A, B
    return A, B

def install(grid):
    loop.time = 1
    setattr(Grid, "x", 2)
    table = constant.COMMANDS
    table["client"] = "mine"
    flower = importlib.import_module("flwr.cli.superlink")
    flower.uvicorn = 3
    a, b = _classes()
    for cls in (a, b):
        cls.claim = 4
    grid.push_messages = 5
    ours = object()
    ours.field = 6
    commands: dict = constant.TASK_TYPE_TO_COMMAND
    commands["client"] = 7
    for fn in _pulls():
        fn.__kwdefaults__ = 8

UTILS = "flwr.supercore.inflatable.inflatable_utils"

def _pulls():
    utils = importlib.import_module(UTILS)
    return [utils.pull]
"""
    found = [c.split(": ", 1)[1] for c in flower_changes(source)]
    expected = ["loop.time", "table['client']", "flower.uvicorn", "cls.claim", "grid.push_messages"]
    expected += ["commands['client']", "fn.__kwdefaults__"]
    assert sorted(found) == sorted([*expected, "setattr(Grid, 'x', 2)"])
