"""The package's import graph: no cycles between modules, and the layers the architecture
names (docs/architecture.md) import only downwards."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fedvlm"


def _graph() -> dict[str, set[str]]:
    """module -> the fedvlm modules it imports, at any depth of its code (a function-level
    import is an edge too)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = {m: set() for m in modules}
    for m, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[m] |= {t for t in targets if t in modules and t != m}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _imports_between(graph, source: str, target: str) -> list[str]:
    return sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith(source) for t in ts if t.startswith(target))


def test_layers_import_only_downwards():
    graph = _graph()
    forbidden = [
        ("fedvlm.strategies", "fedvlm.client_app"),  # the server never runs client code
        ("fedvlm.strategies", "fedvlm.server_app"),  # strategies implement hooks; the loop runs them
        ("fedvlm.privacy", "fedvlm.server_app"),
        ("fedvlm.data", "fedvlm.models"),  # data knows no model
        ("fedvlm.privacy", "fedvlm.strategies"),
        ("fedvlm.privacy", "fedvlm.client_app"),
        ("fedvlm.models", "fedvlm.client_app"),
        ("fedvlm.spec", "fedvlm.strategies"),  # both sides type against the spec
        ("fedvlm.spec", "fedvlm.client_app"),
        ("fedvlm.client_app", "fedvlm.strategies"),  # a node never imports server code ...
        ("fedvlm.methods", "fedvlm.strategies"),  # ... not even through the method table it validates with
        ("fedvlm.methods", "fedvlm.client_app"),  # the table names both sides' classes by path, below both
        ("fedvlm.protocol", "fedvlm.methods"),
        ("fedvlm.spec", "fedvlm.methods"),  # the spec is below the table that fills it
    ]
    found = [edge for source, target in forbidden for edge in _imports_between(graph, source, target)]
    assert not found, found


def test_a_node_imports_no_server_code():
    """What a ClientApp loads to answer a message (its handlers, the run config's validation with
    the method table, every client class) imports no strategy: the table names each strategy by
    path, imported only where a server runs (``spec.MethodSpec.strategy``)."""
    code = (
        "import sys\n"
        "import fedvlm.client_app.app, fedvlm.client_app.handlers\n"
        "from fedvlm.methods.validation import validate\n"
        "cfg = validate({'method': 'dpfpl'})\n"
        "assert cfg.spec.client.__name__ == 'DPFPLClient'\n"
        "print(sorted(m for m in sys.modules if m.startswith(('fedvlm.strategies', 'fedvlm.server_app'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_config_layer_imports_no_method_table_but_its_command_line():
    """``runconfig`` is below the method table; only its command line (``python -m
    fedvlm.runconfig check``, an entry point, at the top like every ``__main__``) validates with it."""
    edges = _imports_between(_graph(), "fedvlm.runconfig", "fedvlm.methods")
    assert edges == ["fedvlm.runconfig.__main__ -> fedvlm.methods.validation"], edges


def test_a_secure_rounds_later_stages_start_without_torch():
    """A deployed node starts a ClientApp process per message: a secure round's shares, masked and
    unmask stages run on what the node kept and load neither torch nor a model (importing torch
    costs about 2 s on two cores, three times a round on every node)."""
    modules = "fedvlm.client_app.app, fedvlm.client_app.secure_aggregation"
    code = f"import sys\nimport {modules}\nprint('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", out
