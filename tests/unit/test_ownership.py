"""Each concern has one owner (docs/architecture.md, "Who owns what"); these rules keep it so.

The round: the loop (``server_app.loop``) runs it, as Flower's ``Strategy.start`` does. It admits
nodes before each phase, so building messages (``configure_*``) needs no network: only the
setup (``start``), the admission (``admit``) and the node registry's handshakes talk to the
grid. It builds each round's record from the round's plan; no strategy writes one.

The privacy budget: the strategies and the loop see the run's ``RunBudget`` (plan, admit, a
node's local sigma, would-exceed, spend, the ledger entry, the audit's inputs, the server's noised
release); the planner behind it is the budget's own, and the mechanisms it plans are the method
table's.

The client: every method's client is a ``client_app.client.Client``, the one contract the
ClientApp calls (``spec.NodeClient``: hello, train, evaluate, the tensors it may share,
its private tensors), built with everything it needs; nothing sets state on it from outside. Every
method trains through the one ``Client.train``; what a round holds lives in the round's session,
not on the client.

The config check: one entry point, ``methods.validation.validate``, builds every ``RunConfig``
(with the method table's defaults and checks).

The reply: a client answers a typed ``TrainReply``/``EvaluateReply`` and the server's checks
return one (``protocol``); the metrics both sides read and the tensors that travel are named once
(``protocol``, ``tensor_names``), so no other module spells them.
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
    # a layer around the strategy hands the grid to the same hook of what it wraps, where the
    # rule holds again (each of these passes it on, and does nothing else with it)
    layers = {"strategies/layer.py", "strategies/secure_aggregation.py", "strategies/reply_bound.py"}
    passed_on = {(f, fn) for f, fn in users if f in layers}
    assert users - passed_on == {
        ("strategies/base.py", "begin"),
        ("strategies/base.py", "admit"),
        ("strategies/nodes.py", "handshake"),
        ("strategies/nodes.py", "wait"),
        ("strategies/nodes.py", "refresh"),
    }
    for path, fn in passed_on:
        tree = ast.parse((PACKAGE / path).read_text())
        func = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == fn)
        calls = [
            c
            for c in ast.walk(func)
            if isinstance(c, ast.Call) and any(isinstance(a, ast.Name) and a.id == "grid" for a in c.args)
        ]
        uses = [n for n in ast.walk(func) if isinstance(n, ast.Name) and n.id == "grid" and isinstance(n.ctx, ast.Load)]
        assert len(calls) == len(uses) == 1, (path, fn)  # the grid goes to one call, and nowhere else
        assert ast.unparse(calls[0].func) == f"self.inner.{fn}", (path, fn)  # the same hook, one layer in


def test_the_rule_sees_a_configure_hook_that_uses_the_grid(tmp_path):
    (tmp_path / "s.py").write_text("def configure_train(self, rnd, arrays, config, grid):\n    grid.get_node_ids()\n")
    assert _functions_loading("grid", tmp_path, tmp_path) == {("s.py", "configure_train")}


SENT = ("messages", "stage_messages")  # what a round's plan records it sent (strategies.plan.PhasePlan)
CHANGES = {"append", "extend", "insert", "remove", "pop", "clear"}  # the list methods that change one


def _writers_of_what_was_sent(root: Path) -> set[str]:
    """Files that change a plan's sent messages: assign them, or call a list method on them."""
    writers = set()
    for path in root.rglob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AugAssign) else []
            for t in targets:
                while isinstance(t, ast.Subscript):  # kept.messages[:] = ...
                    t = t.value
                if (
                    isinstance(t, ast.Attribute)
                    and t.attr in SENT
                    and not (isinstance(t.value, ast.Name) and t.value.id == "self")
                ):
                    writers.add(str(path.relative_to(root)))
            func = n.func if isinstance(n, ast.Call) else None
            if isinstance(func, ast.Attribute) and func.attr in CHANGES:
                if isinstance(func.value, ast.Attribute) and func.value.attr in SENT:
                    writers.add(str(path.relative_to(root)))
    return writers


def test_the_post_is_the_one_writer_of_what_a_round_sent():
    """Issue 65, item 1: what a round sent had three writers (the strategy base, the messages
    module, the secure sum). The strategy's hooks now return messages; the post
    (``server_app.post``) records them as it sends them, with its own map from message to round,
    and needs nothing of the run but its ``Desk``: it imports neither the strategy base nor
    ``RunParts``."""
    assert _writers_of_what_was_sent(PACKAGE) == {"server_app/post.py"}
    tree = ast.parse((PACKAGE / "server_app" / "post.py").read_text())
    imported = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not {m for m, _ in imported if m in {"fedvlm.strategies.base", "fedvlm.strategies.parts"}}
    assert "type: ignore" not in (PACKAGE / "server_app" / "post.py").read_text()


def test_the_writer_rule_sees_each_kind_of_write(tmp_path):
    for i, line in enumerate(
        ["kept.messages.append(m)", "plan.stage_messages.extend(ms)", "kept.messages = []", "kept.messages[:] = x"]
    ):
        (tmp_path / f"w{i}.py").write_text(line + "\n")
    (tmp_path / "reads.py").write_text("sent = {m for m in kept.messages}\nself.messages = []\n")
    assert _writers_of_what_was_sent(tmp_path) == {"w0.py", "w1.py", "w2.py", "w3.py"}


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


# a node-config key spelled like the handshake field it fills: one name, two namespaces
SECOND_HOME = {
    "partition-id": "client_app/node_config.py",
    "num-partitions": "client_app/node_config.py",
    "noise-source": "privacy/mechanisms.py",
}


def _wire_names() -> dict[str, set[str]]:
    """Every name that crosses the wire or lands in a run's figures -> the modules that may spell
    it: the metrics (``fedvlm.metrics``), the messages' config keys and handshake fields
    (``fedvlm.protocol``) and the tensors (``fedvlm.tensor_names``). A plain word without a
    separator ('name', 'dataset', 'failed') is an ordinary word elsewhere too: those, and the
    records' own names ('arrays', 'config', ...: also results.json's keys), are checked where a
    message's content is read (``_content_keys``); the tensors' names always."""
    from fedvlm import metrics, protocol, tensor_names

    tensors = {v for k, v in vars(tensor_names).items() if k.isupper() and isinstance(v, str)}
    names = {name: {"metrics.py"} for name in metrics.METRICS}
    keys = [v for k, v in vars(protocol).items() if k.isupper() and isinstance(v, str) and v not in names]
    keys += [*protocol.HELLO_WORDS.values(), *(k for k, _ in protocol.HELLO_NUMBERS.values())]
    names |= {key: {"protocol.py"} for key in keys}
    names = {k: v for k, v in names.items() if any(c in k for c in "-/._")}
    names |= {name: {"tensor_names.py"} for name in tensors}
    for name, home in SECOND_HOME.items():
        names[name].add(home)
    return names


def _spelled(root: Path, names: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(file, name) for every string literal under ``root`` equal to one of ``names`` outside the
    modules that spell it."""
    found = set()
    for path in root.rglob("*.py"):
        where = str(path.relative_to(root))
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and where not in names.get(n.value, {where}):
                found.add((where, n.value))
    return found


def _content_keys(root: Path) -> set[tuple[str, str]]:
    """(file, key) for every ``<...>.content["..."]`` or ``content["..."]`` read with a literal key."""
    found = set()
    for path in root.rglob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant)):
                continue
            target = n.value
            if (isinstance(target, ast.Attribute) and target.attr == "content") or (
                isinstance(target, ast.Name) and target.id == "content"
            ):
                found.add((str(path.relative_to(root)), str(n.slice.value)))
    return found


def test_every_name_that_crosses_the_wire_is_spelled_once():
    """Issue 46: about twenty metric names were spelled on the client, on the server and in a
    regex allowlist, 'ctx' on 20 lines beside its constant, record keys on both sides; a stale
    spelling ('server-vqa-acc') hid VQA runs from their report. Now each is written in one module."""
    names = _wire_names()
    assert {"num-examples", "local-acc", "server-cider", "ctx", "server-round", "noise-source"} <= set(names)
    assert _spelled(PACKAGE, names) == set()
    assert _content_keys(PACKAGE) == set()


def test_the_spelling_rules_see_a_literal(tmp_path):
    (tmp_path / "s.py").write_text('n = metrics["num-examples"]\nrecord = msg.content["arrays"]\n')
    assert _spelled(tmp_path, _wire_names()) == {("s.py", "num-examples")}
    assert _content_keys(tmp_path) == {("s.py", "arrays")}


def _calls(names: set[str], root: Path) -> set[tuple[str, str]]:
    """(file, name) for every call of one of ``names`` under ``root``."""
    found = set()
    for path in root.rglob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in names:
                found.add((str(path.relative_to(root)), n.func.id))
    return found


def test_a_mechanism_is_defined_only_in_the_method_table():
    """A method's mechanisms are its registry entry's (``local_dp``, ``global_dp``); the budget
    plans them (``RunBudget.planned``): no strategy or client makes up one of its own."""
    outside = {(f, n) for f, n in _calls({"LocalDP", "GlobalDP", "RunBudget"}, PACKAGE) if not f.startswith("privacy/")}
    assert outside == {("methods/registry.py", "LocalDP"), ("methods/registry.py", "GlobalDP")}


def test_the_mechanism_rule_sees_a_strategy_that_makes_one(tmp_path):
    (tmp_path / "s.py").write_text("def global_dp(self):\n    return GlobalDP('x', 'server', 3)\n")
    assert _calls({"GlobalDP"}, tmp_path) == {("s.py", "GlobalDP")}


def _attribute_calls(attr: str, root: Path) -> set[str]:
    """Files under ``root`` that call ``<something>.<attr>(...)``."""
    found = set()
    for path in root.rglob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr:
                found.add(str(path.relative_to(root)))
    return found


def test_a_run_config_is_built_only_by_validate():
    """The config check has one entry point (``methods.validation.validate``, with the method
    table's defaults and checks): nothing else builds a ``RunConfig`` from values."""
    assert _attribute_calls("from_flat", PACKAGE) == {"methods/validation.py"}


def test_the_entry_point_rule_sees_another_builder(tmp_path):
    (tmp_path / "s.py").write_text("cfg = RunConfig.from_flat(values, spec)\n")
    assert _attribute_calls("from_flat", tmp_path) == {"s.py"}


def test_every_method_client_meets_the_one_contract():
    import inspect

    from fedvlm.client_app.client import Client
    from fedvlm.methods.registry import METHODS

    for name, spec in METHODS.items():
        assert issubclass(spec.client, Client), name
        assert not inspect.isabstract(spec.client), f"{name}: {spec.client.__abstractmethods__}"
        params = list(inspect.signature(spec.client).parameters)
        assert params == ["cfg", "node", "state", "server_round", "canaries"], (name, params)
        assert spec.client.train is Client.train, f"{name}: one train skeleton for every method (Client.train)"


def _kept_on_self(root: Path) -> set[tuple[str, str]]:
    """(file, attribute) for every ``self._<name> = ...`` in a client module: what a round holds
    belongs to its session (``begin_round``), not to the client between hooks."""
    found = set()
    for path in root.rglob("*_clients.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
            for e in [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]:
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    if e.attr.startswith("_"):
                        found.add((str(path.relative_to(root)), e.attr))
    return found


def test_no_client_keeps_a_rounds_state_on_itself():
    assert _kept_on_self(PACKAGE / "client_app") == set()


def test_the_session_rule_sees_state_kept_on_a_client(tmp_path):
    (tmp_path / "x_clients.py").write_text("class C:\n    def train(self):\n        self._ctx, self.n = 1, 2\n")
    assert _kept_on_self(tmp_path) == {("x_clients.py", "_ctx")}


def _set_from_outside(attr: str, root: Path) -> set[str]:
    """Files that assign ``<something other than self>.<attr>``."""
    users = set()
    for path in root.rglob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
            for t in targets:
                if (
                    isinstance(t, ast.Attribute)
                    and t.attr == attr
                    and not (isinstance(t.value, ast.Name) and t.value.id == "self")
                ):
                    users.add(str(path.relative_to(root)))
    return users


def test_nothing_sets_a_clients_canaries_from_outside():
    assert _set_from_outside("canaries", PACKAGE) == set()


def test_the_outside_setter_rule_sees_one(tmp_path):
    (tmp_path / "s.py").write_text("client.canaries = node_canaries(cfg)\n")
    assert _set_from_outside("canaries", tmp_path) == {"s.py"}


def _budget_questions(root: Path) -> tuple[set[str], set[str]]:
    """(files comparing a ``.budget`` with None, the methods called on a ``.budget``) under ``root``."""
    compared, called = set(), set()
    for path in root.rglob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(n, ast.Compare)
                and isinstance(n.left, ast.Attribute)
                and n.left.attr == "budget"
                and any(isinstance(c, ast.Constant) and c.value is None for c in n.comparators)
            ):
                compared.add(str(path.relative_to(root)))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                owner = n.func.value
                if isinstance(owner, ast.Attribute) and owner.attr == "budget":
                    called.add(n.func.attr)
    return compared, called


def test_no_caller_asks_whether_privacy_is_on():
    """Issue 46: 16 branches asked whether the strategy had a budget. A run without privacy holds
    a ``NoBudget`` that answers every question ``RunBudget`` does; spending happens only inside
    the budget (``charge_round``, ``charge_replay``, ``charge_abandoned``)."""
    from fedvlm.privacy.budget import NoBudget, RunBudget

    compared, called = _budget_questions(PACKAGE)
    assert compared == set()
    assert called and all(hasattr(NoBudget, m) and hasattr(RunBudget, m) for m in called), called
    assert not {"_spend", "would_exceed", "beyond_promise", "replay_is_fresh"} & called


def test_the_budget_rule_sees_a_branch(tmp_path):
    (tmp_path / "s.py").write_text("if self.budget is not None:\n    self.budget.spend(names)\n")
    assert _budget_questions(tmp_path) == ({"s.py"}, {"spend"})


def _strategy_members(path: Path) -> set[str]:
    """The attributes read on a name ``strategy`` in the file at ``path``."""
    return {
        n.attr
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "strategy"
    }


def test_the_loop_calls_the_strategy_only_through_its_hooks():
    """Issue 46: the loop touched about 20 strategy members, nine of them parts (budget, ledger,
    registry, plans, nodes, global arrays, privacy, cfg, spec). The run's parts are now its own
    (``strategies.parts.RunParts``); the strategy is only called, through ``HOOKS``: Flower's four
    round hooks, the run's start and late nodes, the exchange's two, the checkpoint's state, the
    number of rounds and the outputs."""
    from fedvlm.server_app.loop import HOOKS
    from fedvlm.strategies.base import FederatedStrategy

    assert _strategy_members(PACKAGE / "server_app" / "loop.py") == set(HOOKS)
    assert _strategy_members(PACKAGE / "server_app" / "resume.py") == set()
    assert all(callable(getattr(FederatedStrategy, hook)) for hook in HOOKS)
    flower = {"configure_train", "aggregate_train", "configure_evaluate", "aggregate_evaluate"}
    assert flower <= set(HOOKS) and len(HOOKS) <= len(flower) + 8


def test_the_hook_rule_sees_a_part(tmp_path):
    (tmp_path / "loop.py").write_text("strategy.configure_train(1)\nstrategy.budget.spend(x)\n")
    assert _strategy_members(tmp_path / "loop.py") == {"configure_train", "budget"}


def test_the_loop_holds_the_strategy_only_as_its_hooks_whatever_the_name():
    """The name rule above sees only a variable called ``strategy``; the type rule sees every
    name: the loop imports no strategy class, types every strategy it holds as ``RoundHooks``,
    whose methods are exactly ``HOOKS``, and mypy (run by CI) refuses any other member on it."""
    import typing

    from fedvlm.server_app.loop import HOOKS, RoundHooks

    members = {m for m in vars(RoundHooks) if not m.startswith("_")} - set(typing.Protocol.__dict__)
    assert members == set(HOOKS)
    for name in ("loop.py", "resume.py"):
        tree = ast.parse((PACKAGE / "server_app" / name).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not {i for i in imported if i.endswith("Strategy")}, name
        annotations = [
            ast.unparse(n.annotation) if n.annotation is not None else "(none)"
            for n in ast.walk(tree)
            if isinstance(n, ast.arg) and a_strategy(n)
        ]
        assert all(a == "RoundHooks" for a in annotations), (name, annotations)


def a_strategy(arg: ast.arg) -> bool:
    """A parameter that holds a strategy: by its name or by its type's."""
    text = ast.unparse(arg.annotation) if arg.annotation is not None else ""
    return "strategy" in arg.arg.lower() or "Strategy" in text or "RoundHooks" in text


METHOD_STRATEGIES = ("base.py", "prompt.py", "global_local.py", "lora.py", "pfedmoap.py", "reprogram.py")
# what only a layer around the strategy may touch: the server's release of the global noise, the
# noise the clients draw in shares, the reply bound's rules, the secure sum's protocol
LAYER_NAMES = {"release_global", "distributed_noise", "bound_round", "reply_bounds", "SecureSum", "GDP_SIGMA"}


def test_a_method_strategy_does_not_know_the_layers_it_runs_in():
    """Issue 65: secure aggregation, the global noise and the reply bound wrap the method's strategy
    (``strategies.layers``); none of the strategies names what those layers do, and none replaces
    the round's training pipeline (``aggregate_train``), which each layer builds from its steps."""
    for name in METHOD_STRATEGIES:
        tree = ast.parse((PACKAGE / "strategies" / name).read_text())
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        used |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not used & LAYER_NAMES, (name, used & LAYER_NAMES)
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name == "base.py" or "aggregate_train" not in defined, name


def test_every_layer_is_listed_once_and_wraps_through_the_layer_base():
    from fedvlm.strategies.layer import Layer
    from fedvlm.strategies.layers import LAYERS

    kinds = [layer for _, layer in LAYERS]
    assert len(set(kinds)) == len(kinds) and all(issubclass(k, Layer) for k in kinds)
    defined = {
        n.name
        for path in (PACKAGE / "strategies").glob("*.py")
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.ClassDef) and any(ast.unparse(b) == "Layer" for b in n.bases)
    }
    assert defined == {k.__name__ for k in kinds}  # a layer that no run gets is dead code
