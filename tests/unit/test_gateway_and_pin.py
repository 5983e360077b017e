"""The deployment's two guards, on their own: the Fleet gateway forwards only the Fleet API
(deploy.fleet_gateway), and a node's ClientApp runs only a pinned app (deploy.pinned_app).
tests/e2e/test_deployment.py runs both in a real federation with an outsider."""

from __future__ import annotations

import os

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from fedvlm.deploy.fleet_gateway import FLEET_CALLS, fleet_call, make_app
from fedvlm.deploy.pinned_app import (
    PINS_ENV,
    AppNotPinned,
    build_hash,
    check_fab,
    fab_hash,
    installed_app,
    parse_pin,
    pinned_from_env,
)


def test_only_the_fleet_calls_are_fleet_calls():
    assert {fleet_call("POST", f"/v1/fleet/{c}") for c in FLEET_CALLS} == set(FLEET_CALLS)
    for method, path in [
        ("POST", "/v1/control/start-run"),
        ("POST", "/v1/control/list-runs"),
        ("GET", "/v1/fleet/pull-messages"),  # the Fleet API is POST only
        ("POST", "/v1/fleet/../control/start-run"),
        ("POST", "/v1/fleet/"),
        ("POST", "/v1/fleetx/pull-messages"),
        ("POST", "/runtime/whatever"),
        ("GET", "/docs"),
    ]:
        assert fleet_call(method, path) is None, (method, path)


def _upstream() -> tuple[Starlette, list]:
    seen: list = []

    async def echo(request: Request) -> Response:
        seen.append((request.method, request.url.path, dict(request.headers), await request.body()))
        return Response(b"upstream:" + await request.body(), status_code=200, headers={"x-upstream": "yes"})

    return Starlette(routes=[Route("/{p:path}", echo, methods=["GET", "POST"])]), seen


def test_the_gateway_forwards_the_fleet_api_unchanged_and_refuses_the_rest():
    upstream, seen = _upstream()
    gateway = make_app("127.0.0.1:9093", "", transport=httpx.ASGITransport(app=upstream))
    with TestClient(gateway) as client:
        signed = {"flwr-public-key": "abc", "flwr-signature": "sig", "flwr-timestamp": "t"}
        r = client.post("/v1/fleet/pull-messages", content=b"\x00proto", headers=signed)
        assert r.status_code == 200 and r.content == b"upstream:\x00proto" and r.headers["x-upstream"] == "yes"
        method, path, headers, body = seen[-1]
        assert (method, path, body) == ("POST", "/v1/fleet/pull-messages", b"\x00proto")
        assert all(headers[k] == v for k, v in signed.items())  # SuperNode authentication passes through
        for method, path in [("POST", "/v1/control/start-run"), ("GET", "/v1/control/list-runs"), ("GET", "/")]:
            r = client.request(method, path)
            assert r.status_code == 403 and "Control API" in r.text and "SSH tunnel" in r.text, path
    assert len(seen) == 1  # nothing else reached the SuperLink


def _app(root, text: str):
    root.mkdir()
    (root / "pyproject.toml").write_text(
        '[project]\nname = "demo"\nversion = "1.0.0"\ndescription = "d"\nlicense = "Apache-2.0"\n'
        'dependencies = ["flwr"]\n\n[tool.flwr.app]\npublisher = "someone"\n\n'
        '[tool.flwr.app.components]\nserverapp = "demo:server"\nclientapp = "demo:client"\n\n[tool.flwr.app.config]\n'
    )
    (root / "demo.py").write_text(text)
    return root


def test_an_app_hash_is_what_flower_builds_and_changes_with_one_byte(tmp_path):
    from flwr.cli.build import build_fab_from_disk

    app = _app(tmp_path / "a", "x = 1\n")
    digest, name = build_hash(app)
    assert name == "someone/demo 1.0.0"
    assert digest == build_hash(app)[0] == fab_hash(build_fab_from_disk(app))  # deterministic
    (app / "demo.py").write_text("x = 2\n")
    assert build_hash(app)[0] != digest
    fab = tmp_path / "demo.fab"
    fab.write_bytes(build_fab_from_disk(app))
    assert build_hash(fab)[0] == build_hash(app)[0]  # a .fab file hashes the same


def test_a_node_runs_only_a_pinned_app_and_fails_closed_without_pins(tmp_path, monkeypatch):
    from flwr.cli.build import build_fab_from_disk

    ours = build_fab_from_disk(_app(tmp_path / "ours", "x = 1\n"))
    theirs = build_fab_from_disk(_app(tmp_path / "theirs", "import os  # anything\n"))
    pins = frozenset({fab_hash(ours)})
    check_fab(ours, pins)
    with pytest.raises(AppNotPinned, match=rf"pinned \(sha256 {fab_hash(ours)}\).*someone/demo 1.0.0 has sha256 "):
        check_fab(theirs, pins)
    monkeypatch.setitem(os.environ, PINS_ENV, f"sha256:{fab_hash(ours).upper()}, ")
    assert pinned_from_env() == pins
    monkeypatch.setitem(os.environ, PINS_ENV, "")
    with pytest.raises(AppNotPinned, match="empty"):
        pinned_from_env()
    with pytest.raises(ValueError, match="not a SHA-256"):
        parse_pin("6def36ef")


def test_an_installed_app_is_found_by_its_exact_bytes_only(tmp_path, monkeypatch):
    from flwr.cli.build import build_fab_from_disk
    from flwr.cli.install import install_from_fab

    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "home"))
    ours = build_fab_from_disk(_app(tmp_path / "ours", "x = 1\n"))
    changed = build_fab_from_disk(_app(tmp_path / "changed", "x = 2\n"))  # same name and version
    assert installed_app(ours) is None  # not installed yet: Flower installs it
    path = install_from_fab(ours, skip_prompt=True)
    assert installed_app(ours) == path and (path / "demo.py").read_text() == "x = 1\n"
    assert installed_app(changed) is None  # other bytes: another folder, installed by Flower
    assert installed_app(b"not a zip") is None  # Flower's install reports what is wrong with it


def test_exec_without_a_server_key_is_refused_unless_said_in_words(capsys, monkeypatch):
    """Without --server-key the node ran unsigned instructions after a warning nobody reads."""
    from fedvlm.deploy import pinned_app

    started = []
    monkeypatch.setattr(pinned_app, "_exec", lambda *a: started.append(a))
    monkeypatch.setattr(pinned_app, "log_beside_flower", lambda: None)
    pin = "sha256:" + "ab" * 32
    with pytest.raises(SystemExit) as refused:
        pinned_app.main(["exec", "--pin", pin, "--", "--insecure"])
    assert refused.value.code == 2 and not started
    assert "--server-key is required" in capsys.readouterr().err
    assert pinned_app.main(["exec", "--pin", pin, "--accept-unsigned-instructions", "--", "--insecure"]) == 0
    assert len(started) == 1 and started[0][1] == []  # it runs, with no key, only when the operator said so


@pytest.mark.parametrize("body", [b"", b"\x00\x01random bytes", b"PK\x03\x04garbage"])
def test_hash_refuses_a_file_that_is_not_an_app(tmp_path, capsys, body):
    """An operator pinned the hash of a truncated download: `hash` printed it as '(unnamed app)'."""
    from fedvlm.deploy import pinned_app

    (tmp_path / "app.fab").write_bytes(body)
    with pytest.raises(SystemExit):
        pinned_app.main(["hash", str(tmp_path / "app.fab")])
    assert "is not a Flower app (.fab) file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pinned_app.main(["hash", str(tmp_path / "nowhere")])
    assert "neither a .fab file nor an app folder" in capsys.readouterr().err


def test_the_project_app_is_its_code_alone_and_its_pin_ignores_docs_and_results(tmp_path):
    """Every node receives the FAB with every message, and organisations pin its hash: it holds
    the package's Python files and Flower's two own entries, so committing results or docs (the
    FAB once carried docs/results, tests and benchmarks: 3.0 MB) neither grows it nor moves a pin."""
    import io
    import shutil
    import subprocess
    import zipfile
    from pathlib import Path

    from flwr.cli.build import build_fab_from_disk

    root = Path(__file__).resolve().parents[2]
    names = set(zipfile.ZipFile(io.BytesIO(build_fab_from_disk(root))).namelist())
    tracked = subprocess.run(["git", "ls-files", "fedvlm"], cwd=root, capture_output=True, text=True).stdout.split()
    code = {n for n in tracked if n.endswith(".py")}
    assert code and code <= names  # an app that runs: all of the package
    assert names - code == {"pyproject.toml", ".info/CONTENT"}  # and nothing else
    copy = tmp_path / "app"
    shutil.copytree(root / "fedvlm", copy / "fedvlm", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(root / "pyproject.toml", copy)
    pin = build_hash(copy)[0]
    (copy / "docs" / "results").mkdir(parents=True)
    (copy / "docs" / "results" / "new.json").write_text('{"accuracy": 0.5}\n')
    (copy / "README.md").write_text("# changed\n")
    assert build_hash(copy)[0] == pin
    (copy / "fedvlm" / "extra.py").write_text("x = 1\n")
    assert build_hash(copy)[0] != pin  # the code is still what the pin covers
