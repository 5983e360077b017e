"""The deployment path: credentials, Docker files, and a real federation on loopback.

The loopback tests start a SuperLink with TLS and SuperNode authentication and SuperNodes as
separate processes on 127.0.0.1 (deploy.local_federation, the steps of docs/deployment.md),
run the embedded default through `flwr run`, and stop every process by PID at the end, also
when a test fails."""

from __future__ import annotations

import json
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

from fedvlm.deploy.credentials import CredentialsError, generate
from fedvlm.utils.processes import pids_matching

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


# ---- credentials ---------------------------------------------------------------------------

def test_credentials_make_a_ca_a_server_certificate_and_supernode_keys(tmp_path):
    out = tmp_path / "creds"
    done = generate(out, ["superlink.example.org"], ["10.0.0.5"], ["org-a", "org-b"])
    assert done["created"] == ["ca.crt", "server.crt", "supernodes/org-a", "supernodes/org-b"]
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    for secret in ("ca.key", "server.key", "supernodes/org-a", "supernodes/org-b"):
        assert mode(out / secret) == 0o600, secret
    assert mode(out) == 0o700

    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((out / "server.crt").read_bytes())
    server.verify_directly_issued_by(ca)  # raises if the CA did not sign it
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["superlink.example.org"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]

    # What flower-supernode and `flwr supernode register` read: EC P-384 keys in OpenSSH format.
    priv = load_ssh_private_key((out / "supernodes" / "org-a").read_bytes(), password=None)
    pub = load_ssh_public_key((out / "supernodes" / "org-a.pub").read_bytes())
    assert isinstance(priv, ec.EllipticCurvePrivateKey) and priv.curve.name == "secp384r1"
    assert priv.public_key().public_numbers() == pub.public_numbers()


def test_credentials_add_organisations_later_without_touching_existing_ones(tmp_path):
    out = tmp_path / "creds"
    generate(out, ["localhost"], [], ["org-a"])
    before = {p: (out / p).read_bytes() for p in ("ca.crt", "ca.key", "server.crt", "supernodes/org-a")}
    done = generate(out, ["localhost"], [], ["org-a", "org-c"])
    assert done["created"] == ["supernodes/org-c"] and set(done["kept"]) == {"ca.crt", "server.crt", "supernodes/org-a"}
    assert all((out / p).read_bytes() == b for p, b in before.items())
    server = x509.load_pem_x509_certificate((out / "server.crt").read_bytes())
    server.verify_directly_issued_by(x509.load_pem_x509_certificate((out / "ca.crt").read_bytes()))


def test_credentials_refuse_bad_input(tmp_path):
    with pytest.raises(CredentialsError, match="not an IP address"):
        generate(tmp_path / "a", ["localhost"], ["superlink.example.org"], [])
    with pytest.raises(CredentialsError, match="at least one --server-name or --server-ip"):
        generate(tmp_path / "b", [], [], [])
    with pytest.raises(CredentialsError, match="must be 1-64 letters"):
        generate(tmp_path / "c", ["localhost"], [], ["../escape"])
    generate(tmp_path / "d", ["localhost"], [], [])
    (tmp_path / "d" / "ca.key").unlink()
    with pytest.raises(CredentialsError, match="only one of ca.crt and ca.key"):
        generate(tmp_path / "d", ["localhost"], [], [])


def test_no_credential_can_be_committed_or_baked_into_an_image(tmp_path):
    generate(ROOT / "docker" / "credentials", ["localhost"], [], ["org-0"])
    try:
        for path in ("docker/credentials/ca.key", "docker/credentials/supernodes/org-0", "docker/data/client-0/x.png",
                     "some/where/credentials/server.key"):
            assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path
        ignored = (ROOT / ".dockerignore").read_text().split()
        assert "docker/credentials/" in ignored and "*.key" in ignored
    finally:
        shutil.rmtree(ROOT / "docker" / "credentials")


# ---- Docker files --------------------------------------------------------------------------

def _compose_tool() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


@pytest.mark.skipif(_compose_tool() is None, reason="neither `docker compose` nor `docker-compose` is installed")
def test_compose_files_validate():
    tool = _compose_tool()
    for files in (["compose.yml"], ["compose.yml", "compose.gpu.yml"]):
        args = [a for f in files for a in ("-f", str(ROOT / "docker" / f))]
        proc = subprocess.run([*tool, *args, "config"], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    assert {"superlink", "supernode-0", "supernode-1"} <= set(yaml.safe_load(proc.stdout)["services"])


def _flags(text: str) -> set[str]:
    return set(re.findall(r"(--[a-z][a-z0-9-]+)", text))


def test_compose_and_dockerfiles_use_real_flags_and_real_files():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yml").read_text())
    link_help = subprocess.run([str(BIN / "flower-superlink"), "--help"], capture_output=True, text=True).stdout
    node_help = subprocess.run([str(BIN / "flower-supernode"), "--help"], capture_output=True, text=True).stdout
    superlink_cmd = (ROOT / "docker" / "superlink.Dockerfile").read_text().split("CMD", 1)[1]
    assert _flags(superlink_cmd) <= _flags(link_help), _flags(superlink_cmd) - _flags(link_help)
    for name, svc in compose["services"].items():
        if name.startswith("supernode"):
            used = {c.split("=", 1)[0] for c in svc["command"]}
            assert used <= _flags(node_help), used - _flags(node_help)
            assert {"--root-certificates", "--auth-supernode-private-key", "--superlink"} <= used  # TLS + auth
            assert not any("--insecure" in c for c in svc["command"])
        build = svc.get("build") or compose["x-supernode"]["build"]
        assert (ROOT / "docker" / build["context"] / build["dockerfile"]).is_file()
    for dockerfile in (ROOT / "docker").glob("*.Dockerfile"):
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY "):
                for src in line.split()[1:-1]:
                    assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src} does not exist"
    # every package the wheel ships is copied into the images
    packages = re.search(r"packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text()).group(1)
    copied = (ROOT / "docker" / "supernode.Dockerfile").read_text()
    for pkg in re.findall(r'"([a-z_]+)"', packages):
        assert f"COPY {pkg} " in copied, pkg


# ---- a real federation on loopback ---------------------------------------------------------

pytest_e2e = pytest.mark.e2e


@pytest.fixture(scope="module")
def federation(tmp_path_factory, cache_dir, pretrained_clip):
    from fedvlm.deploy.local_federation import LocalFederation

    work = tmp_path_factory.mktemp("federation")
    fed = LocalFederation(work, ["org-0", "org-1"], {
        "org-0": "partition-id=0 num-partitions=2", "org-1": "partition-id=1 num-partitions=2"})
    with fed:
        fed.make_credentials(extra=["org-own", "org-bad", "intruder"])  # keys made, not registered
        _wait_online(fed, 2)
        yield fed
    assert not pids_matching(str(work)), "a Flower process of the federation survived the test"


def _nodes(fed) -> list[dict]:
    proc = fed.flwr("supernode", "list", "loopback", "--format", "json", timeout=60)
    return json.loads(proc.stdout)["nodes"] if proc.returncode == 0 else []


def _wait_online(fed, n: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if sum(node["status"] == "online" for node in _nodes(fed)) >= n:
            return
        time.sleep(1)
    raise AssertionError(f"fewer than {n} SuperNodes online after {timeout} s: {_nodes(fed)}\n"
                         + "\n".join(fed.log_text(name)[-1500:] for name in fed.procs))


def _untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if "seconds" not in k}


@pytest_e2e
def test_deployment_with_tls_and_auth_matches_the_simulation(federation, flwr_env, tmp_path, cache_dir):
    common = f"num-server-rounds=2 cache-dir='{cache_dir}' round-timeout=120 run-name='r'"
    dep = federation.run_app(f"{common} output-dir='{tmp_path / 'deployed'}'", timeout=900)
    log = dep.stdout + dep.stderr
    path = tmp_path / "deployed" / "r" / "results.json"
    assert path.exists(), log[-4000:]
    deployed = json.loads(path.read_text())
    assert deployed["run"]["status"] == "finished", log[-3000:]
    assert sorted(n["name"] for n in deployed["run"]["nodes"]) == ["client-0", "client-1"]
    assert "[round 2/2]" in log

    sim = subprocess.run([str(BIN / "flwr"), "run", str(ROOT), "--stream", "--federation-config", "num-supernodes=2",
                          "--run-config", f"{common} output-dir='{tmp_path / 'simulated'}'"],
                         env=flwr_env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    path = tmp_path / "simulated" / "r" / "results.json"
    assert path.exists(), (sim.stdout + sim.stderr)[-4000:]
    simulated = json.loads(path.read_text())
    # Parity: the same config and seed give the same per-round numbers. Sampling is seeded over
    # node names (not Flower's random node ids), every node derives its partition and its
    # generators from the seed, and on the CPU the arithmetic is the same in a Ray worker and
    # in a SuperNode's ClientApp process.
    for d, s in zip(deployed["rounds"], simulated["rounds"], strict=True):
        dm, sm = _untimed(d["metrics"]), _untimed(s["metrics"])
        assert dm.keys() == sm.keys()
        for k in dm:
            assert dm[k] == pytest.approx(sm[k], rel=1e-6, abs=1e-9), (d["round"], k)
        assert d["bytes"] == s["bytes"]
    assert _untimed(deployed["final"]) == pytest.approx(_untimed(simulated["final"]))


@pytest_e2e
def test_an_unregistered_supernode_is_refused(federation):
    proc = federation.start_supernode("intruder", "partition-id=0 num-partitions=2")
    try:
        code = proc.wait(timeout=120)
    finally:
        federation.stop("intruder")
    assert code != 0
    assert "Failed to activate SuperNode" in federation.log_text("intruder")
    assert len(_nodes(federation)) == 2  # still only the two registered nodes


@pytest_e2e
def test_own_data_nodes_join_and_a_killed_node_leaves_the_rounds_to_the_others(federation, tmp_path, cache_dir):
    from fedvlm.data.export_folder import export_partitions
    from fedvlm.data.registry import load_image_folder

    own = export_partitions(tmp_path / "org-data", 2)[0]
    for name in ("org-own", "org-bad"):
        reg = federation.register(name)
        assert reg.returncode == 0, reg.stdout + reg.stderr
    federation.start_supernode("org-own", f"data-dir='{own}' name='org-own'")
    federation.start_supernode("org-bad", f"data-dir='{tmp_path / 'no-such-folder'}' name='org-bad'")
    _wait_online(federation, 4)

    out = tmp_path / "runs"
    run = subprocess.Popen(
        [str(BIN / "flwr"), "run", str(ROOT), "loopback", "--stream", "--run-config",
         f"num-server-rounds=3 min-nodes=2 round-timeout=60 cache-dir='{cache_dir}' output-dir='{out}' run-name='k'"],
        env=federation.env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    results = out / "k" / "results.json"
    try:
        deadline = time.time() + 600
        while time.time() < deadline and run.poll() is None:
            if results.exists() and len(json.loads(results.read_text()).get("rounds", [])) >= 1:
                break
            time.sleep(0.5)
        federation.stop("org-1")  # an organisation's machine goes away during round 2
        log, _ = run.communicate(timeout=900)
    finally:
        if run.poll() is None:
            run.kill()
    data = json.loads(results.read_text())
    assert data["run"]["status"] == "finished", log[-4000:]
    nodes = {n["name"]: n for n in data["run"]["nodes"]}
    assert set(nodes) == {"client-0", "client-1", "org-own"}
    split = load_image_folder(own, 0.3)
    assert nodes["org-own"]["num_train"] == len(split.train) and nodes["org-own"]["partition_id"] == -1
    # the node whose folder is missing was excluded at the handshake with its own error
    assert any("no-such-folder" in r and "does not exist" in r for r in data["run"]["excluded_nodes"].values())
    trained = [r["metrics"]["train-clients"] for r in data["rounds"]]
    assert trained[0] == 3 and trained[-1] == 2, trained
    assert "client-1" not in data["rounds"][-1]["clients"]
    # the SuperLink answers for the dead node ("Node Unavailable"); the server names the node
    lost = [d for r in data["rounds"] for d in r["dropped"]]
    assert lost and all(d["client"] == "client-1" for d in lost), lost
