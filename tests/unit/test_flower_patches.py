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


def _installers(root: Path, modules: dict[str, str]) -> dict[str, set[str]]:
    """Patch name -> the files under ``root`` that call its module's ``install`` (``modules``:
    the patch modules by dotted name -> patch name)."""
    found: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}  # a local name -> the patch whose install it is, or whose module it is
        own = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        if own in modules:  # a patch module calling its own install
            aliases["install"] = modules[own]
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module:
                for a in n.names:
                    full = f"{n.module}.{a.name}"
                    if full in modules:
                        aliases[a.asname or a.name] = modules[full]
                    elif n.module in modules and a.name == "install":
                        aliases[a.asname or a.name] = modules[n.module]
        for n in ast.walk(tree):
            if not isinstance(n, ast.Call):
                continue
            f = n.func
            if isinstance(f, ast.Attribute) and f.attr == "install" and isinstance(f.value, ast.Name):
                patch = aliases.get(f.value.id)
            elif isinstance(f, ast.Name):
                patch = aliases.get(f.id) if f.id == "install" else None
            else:
                patch = None
            if patch is not None:
                found.setdefault(patch, set()).add(str(path.relative_to(root.parent)))
    return found


def test_only_the_processes_that_need_a_patch_install_it():
    modules = {p.module: p.name for p in PATCHES}
    found = _installers(PACKAGE, modules)
    for p in PATCHES:  # a patch's own module may install another (the SuperNode's command installs three)
        assert found.get(p.name, set()) == set(p.installed_by), p.name


def test_the_installer_rule_sees_a_call(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("from fedvlm.deploy import object_pulls\nobject_pulls.install(1.0)\n")
    lazy = "def f():\n    from fedvlm.deploy.clientapp_forks import install\n    install('x', 'y')\n"
    (pkg / "b.py").write_text(lazy)
    modules = {"fedvlm.deploy.object_pulls": "object-pulls", "fedvlm.deploy.clientapp_forks": "clientapp-forks"}
    assert _installers(pkg, modules) == {"object-pulls": {"pkg/a.py"}, "clientapp-forks": {"pkg/b.py"}}


def test_every_patch_is_documented_where_an_operator_reads():
    text = (ROOT / "docs" / "deployment.md").read_text()
    assert all(f"`{p.name}`" in text for p in PATCHES)
    assert flower_patches.BY_NAME.keys() == {p.name for p in PATCHES}
