"""Deployment files: credentials (deploy.credentials), Docker and Compose files."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

from fedvlm.deploy.credentials import CredentialsError, generate
from fedvlm.methods.registry import FAMILIES
from fedvlm.models import prepare
from fedvlm.secagg.roster import Identity, Roster, verify

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


# ---- credentials ---------------------------------------------------------------------------


def test_credentials_make_a_ca_a_server_certificate_and_supernode_keys(tmp_path):
    out = tmp_path / "creds"
    umask = os.umask(0o077)  # docs/deployment.md's operator (and the image's tools) write owner-only
    try:
        done = generate(out, ["superlink.example.org"], ["10.0.0.5"], ["org-a", "org-b"])
    finally:
        os.umask(umask)
    orgs = [f"supernodes/{org}{what}" for org in ("org-a", "org-b") for what in ("", ".identity")]
    assert done["created"] == ["ca.crt", "server.crt", "server-signing.key", *orgs]
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    for secret in ("ca.key", "server.key", "server-signing.key", *orgs):
        assert mode(out / secret) == 0o600, secret
    # what other accounts (the containers', the researcher's) read, whatever the umask
    for public in ("ca.crt", "server.crt", "server-signing.pub", "roster.json", *(f"{o}.pub" for o in orgs)):
        assert mode(out / public) == 0o644, public
    assert mode(out) == 0o700
    # the roster lists each organisation's identity, the key its private one signs with
    roster = Roster.load(out / "roster.json")
    for org in ("org-a", "org-b"):
        identity = Identity.load(out / "supernodes" / f"{org}.identity")
        assert roster.member(identity.public) == org and verify(identity.public, b"m", identity.sign(b"m"))

    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((out / "server.crt").read_bytes())
    server.verify_directly_issued_by(ca)  # raises if the CA did not sign it
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    # the names asked for, and loopback always: the SuperLink's own processes dial it there
    assert sans.get_values_for_type(x509.DNSName) == ["superlink.example.org", "localhost"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.5", "127.0.0.1"]

    # What flower-supernode and `flwr supernode register` read: EC P-384 keys in OpenSSH format.
    priv = load_ssh_private_key((out / "supernodes" / "org-a").read_bytes(), password=None)
    pub = load_ssh_public_key((out / "supernodes" / "org-a.pub").read_bytes())
    assert isinstance(priv, ec.EllipticCurvePrivateKey) and priv.curve.name == "secp384r1"
    assert priv.public_key().public_numbers() == pub.public_numbers()


def test_credentials_add_organisations_later_without_touching_existing_ones(tmp_path):
    out = tmp_path / "creds"
    generate(out, ["localhost"], [], ["org-a"])
    kept = ("ca.crt", "ca.key", "server.crt", "server-signing.key", "server-signing.pub", "supernodes/org-a")
    kept += ("supernodes/org-a.identity", "supernodes/org-a.identity.pub")
    before = {p: (out / p).read_bytes() for p in kept}
    done = generate(out, ["localhost"], [], ["org-a", "org-c"])
    assert done["created"] == ["supernodes/org-c", "supernodes/org-c.identity"]
    kept_now = {"ca.crt", "server.crt", "server-signing.key", "supernodes/org-a", "supernodes/org-a.identity"}
    assert set(done["kept"]) == kept_now
    assert all((out / p).read_bytes() == b for p, b in before.items())
    assert sorted(Roster.load(out / "roster.json").members) == ["org-a", "org-c"]
    server = x509.load_pem_x509_certificate((out / "server.crt").read_bytes())
    server.verify_directly_issued_by(x509.load_pem_x509_certificate((out / "ca.crt").read_bytes()))


def test_credentials_refuse_bad_input(tmp_path):
    with pytest.raises(CredentialsError, match="not an IP address"):
        generate(tmp_path / "a", ["localhost"], ["superlink.example.org"], [])
    only_loopback = generate(tmp_path / "b", [], [], [])  # a SuperLink reached on its host only
    assert only_loopback["created"] == ["ca.crt", "server.crt", "server-signing.key"]
    with pytest.raises(CredentialsError, match="must be 1-64 letters"):
        generate(tmp_path / "c", ["localhost"], [], ["../escape"])
    generate(tmp_path / "d", ["localhost"], [], [])
    (tmp_path / "d" / "ca.key").unlink()
    with pytest.raises(CredentialsError, match="only one of ca.crt and ca.key"):
        generate(tmp_path / "d", ["localhost"], [], [])
    # every argument is checked before anything is written (a bad one left a CA behind, a day of
    # 0 made a CA valid for 5 minutes, a huge one an OverflowError)
    for args, words in (
        ((["localhost"], [], [], 0), "--days 0: certificates must be valid for 1 to"),
        ((["localhost"], [], [], 99_999_999), "--days 99999999"),
        (([""], [], [], 365), "--server-name '' is not a host name"),
        ((["localhost"], [], ["ö-org"], 365), "must be 1-64 letters"),
    ):
        with pytest.raises(CredentialsError, match=words):
            generate(tmp_path / "e", *args)
        assert not (tmp_path / "e").exists()
    (tmp_path / "f").write_text("a file")
    with pytest.raises(CredentialsError, match="--out .* is a file"):
        generate(tmp_path / "f", ["localhost"], [], [])
    generate(tmp_path / "g", ["localhost"], [], [])
    (tmp_path / "g" / "ca.key").write_bytes((tmp_path / "g" / "ca.key").read_bytes()[:60])
    with pytest.raises(CredentialsError, match=r"ca\.key cannot be read .*restore it from a backup"):
        generate(tmp_path / "g", ["localhost"], [], [], force=True)


def test_no_credential_can_be_committed_or_baked_into_an_image(tmp_path):
    generate(ROOT / "docker" / "credentials", ["localhost"], [], ["org-0"])
    try:
        for path in (
            "docker/credentials/ca.key",
            "docker/credentials/supernodes/org-0",
            "docker/data/client-0/x.png",
            "some/where/credentials/server.key",
        ):
            assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path
        ignored = (ROOT / ".dockerignore").read_text().split()
        assert "docker/credentials/" in ignored and "*.key" in ignored
    finally:
        shutil.rmtree(ROOT / "docker" / "credentials")


# ---- Docker files --------------------------------------------------------------------------

COMPOSE_ENV = {"APP_PIN": "sha256:" + "0" * 64, "RESEARCHER_UID": "1000"}  # docker/.env holds the real ones


def _compose_tool() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


@pytest.mark.skipif(_compose_tool() is None, reason="neither `docker compose` nor `docker-compose` is installed")
def test_compose_files_validate_and_need_the_pin():
    tool = _compose_tool()
    env = {**os.environ, **COMPOSE_ENV}
    for files in (["compose.yml"], ["compose.yml", "compose.gpu.yml"]):
        args = [a for f in files for a in ("-f", str(ROOT / "docker" / f))]
        proc = subprocess.run([*tool, *args, "config"], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    orgs = {f"{role}-{i}" for role in ("supernode", "exec", "worker") for i in (0, 1)}
    assert set(services) == {"superlink", "gateway", *orgs}
    for needed in COMPOSE_ENV:  # no pin, or no researcher's account named: no federation
        short = {
            **{k: v for k, v in os.environ.items() if k != needed},
            **{k: v for k, v in COMPOSE_ENV.items() if k != needed},
        }
        proc = subprocess.run(
            [*tool, "-f", str(ROOT / "docker" / "compose.yml"), "config"], capture_output=True, text=True, env=short
        )
        assert proc.returncode != 0 and needed in proc.stderr + proc.stdout, needed


def _flags(text: str) -> set[str]:
    return set(re.findall(r"(--[a-z][a-z0-9-]+)", text))


def _help(*cmd: str) -> set[str]:
    return _flags(subprocess.run(cmd, capture_output=True, text=True).stdout)


def _target(mount: str) -> str:
    """A compose volume's path in the container (the host side may hold ${VAR:-default})."""
    return mount.rsplit(":", 2)[1] if mount.endswith((":ro", ":rw")) else mount.rsplit(":", 1)[1]


def test_compose_runs_least_privilege_with_real_flags():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yml").read_text())
    base = compose["x-fedvlm"]
    assert base["network_mode"] == "host" and base["user"] == "10001"  # no bridge network, never root
    assert base["logging"]["options"]["max-size"]  # Docker rotates every container's log
    helps = {
        "fedvlm.deploy.superlink": _help(sys.executable, "-m", "fedvlm.deploy.superlink", "--help")
        | _help(str(BIN / "flower-superlink"), "--help"),
        "fedvlm.deploy.supernode_polling": _help(sys.executable, "-m", "fedvlm.deploy.supernode_polling", "--help")
        | _help(str(BIN / "flower-supernode"), "--help"),
        "fedvlm.deploy.fleet_gateway": _help(sys.executable, "-m", "fedvlm.deploy.fleet_gateway", "--help"),
        "fedvlm.deploy.pinned_app": _help(sys.executable, "-m", "fedvlm.deploy.pinned_app", "exec", "--help")
        | _help(str(BIN / "flower-superexec"), "--help"),
        "fedvlm.deploy.node_worker": _help(sys.executable, "-m", "fedvlm.deploy.node_worker", "--help"),
    }
    for name, svc in compose["services"].items():
        assert not {"ports", "networks"} & set(svc), name  # host networking only
        # reaped children, no capabilities or privilege gain, and writes only to volumes and /tmp
        assert svc["init"] is True and svc["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in svc["security_opt"] and svc["read_only"] is True, name
        assert [t.split(":")[0] for t in svc["tmpfs"]] == ["/tmp"], name
        assert svc["environment"]["FLWR_HOME"].startswith("/tmp/"), name  # Flower's app store
        cmd = svc["command"]
        program = next(p for p in helps if p in cmd)
        used = {c.split("=", 1)[0] for c in cmd if c.startswith("--") and c != "--"}
        assert used <= helps[program], (name, used - helps[program])
        mounts = svc.get("volumes", [])
        data = [m for m in mounts if _target(m) == "/data"]
        assert all(m.endswith(":ro") for m in data), name  # the organisation's images: read-only
        assert all(m.endswith(":ro") for m in mounts if "/credentials/" in m or "/secrets/" in m), name
        # the federation's side runs as an account of its own, which the organisations' containers are not
        assert svc["user"] == ("10000" if name in ("superlink", "gateway") else "10001"), name
        if program == "fedvlm.deploy.superlink":
            assert "--host=127.0.0.1" in cmd and "--enable-supernode-auth" in cmd and "--insecure" not in cmd
            assert "--allow-uid=10000" in cmd and "--allow-uid=10001" not in cmd and "--signing-key" in used
        if program == "fedvlm.deploy.supernode_polling":
            assert not data  # the network-facing process never sees the data
            assert {"--root-certificates", "--auth-supernode-private-key", "--isolation", "--host", "--pin"} <= used
            assert "--host=127.0.0.1" in cmd and "--insecure" not in cmd
            (node_config,) = [c for c in cmd if c.startswith("--node-config=")]
            assert "max-epsilon=" in node_config and "delta=" in node_config  # every documented node has a limit
        if program == "fedvlm.deploy.pinned_app":
            assert data and any(c.startswith("--pin=") for c in cmd) and "--server-key" in used
            assert any(c.startswith("--runtime-api-address=127.0.0.1:") for c in cmd)  # loopback only
        if program == "fedvlm.deploy.node_worker":  # its socket is on a volume only its exec shares
            (sock,) = [c.split("=", 1)[1] for c in cmd if c.startswith("--socket=")]
            (volume,) = [m.split(":")[0] for m in mounts if _target(m) == str(Path(sock).parent)]
            peers = [
                n
                for n, other in compose["services"].items()
                if any(m.split(":")[0] == volume for m in other.get("volumes", []))
            ]
            assert sorted(peers) == sorted([name, name.replace("worker", "exec")]), peers


def _imported_files(module: str) -> set[str]:
    """The project files ``module`` imports at any depth, function-level imports included (the
    embedded VLM's pretraining imports its batching lazily)."""
    import ast

    def path(name: str) -> Path:
        p = ROOT / Path(*name.split("."))
        return p.with_suffix(".py") if p.with_suffix(".py").exists() else p / "__init__.py"

    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen or not path(name).exists():
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # the packages' __init__
        for node in ast.walk(ast.parse(path(name).read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fedvlm"):
                todo += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.startswith("fedvlm")]
    return {str(path(n).relative_to(ROOT)) for n in seen}


def test_the_image_copies_real_files_and_bakes_exactly_what_pretraining_imports():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    copies = [
        line.split()[1:-1] for line in dockerfile.splitlines() if line.startswith("COPY ") and "--from" not in line
    ]
    for sources in copies:
        for src in sources:
            if not src.startswith("--"):
                assert (ROOT / src).exists(), f"COPY {src} does not exist"
    # one stage per method family, copying exactly what that family's pretraining imports, run
    # only when its build argument says so; the final image takes every stage's models
    assert set(prepare.FAMILY_MODELS) == set(FAMILIES)
    final = dockerfile.rsplit("\nFROM ", 1)[1]
    for family, module in prepare.FAMILY_MODELS.items():
        stage = dockerfile.split(f"AS {family}-models\n", 1)[1].split("\nFROM ", 1)[0]
        baked = {src for line in stage.splitlines() if line.startswith("COPY ") for src in line.split()[1:-1]}
        assert baked == _imported_files("fedvlm.models.prepare") | _imported_files(module), family
        assert f"ARG {prepare.BUILD_ARGS[family]}=1" in stage
        assert f"fedvlm.models.prepare --family {family} " in stage
        assert f"COPY --from={family}-models --chown=app:app " in final
    # the source is copied after the dependencies and the weights: a code edit reuses both
    assert "COPY fedvlm ./fedvlm" in final and "pip install -c constraints.txt" not in final


def test_an_image_refuses_a_family_it_was_built_without(tmp_path, monkeypatch):
    """In an image (FEDVLM_PRETRAINING=refuse) a missing embedded model is an error naming the
    build argument, not minutes of pretraining on every node; a model that is there loads."""
    from fedvlm.models import tiny_clip

    monkeypatch.setenv("FEDVLM_PRETRAINING", prepare.REFUSE)
    with pytest.raises(prepare.NotInImage, match="--build-arg EMBEDDED_PROMPT=1"):
        tiny_clip.load_embedded_clip(tmp_path)
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").glob("*.pt"))
    for family in prepare.FAMILY_MODELS:
        with pytest.raises(prepare.NotInImage, match=prepare.BUILD_ARGS[family]):
            for make in prepare.models_of(family).values():
                make(tmp_path)


def test_export_folder_names_each_folder_as_a_node_must_be_given_it(tmp_path, monkeypatch, capsys, cache_dir):
    """A relative --out was printed back relative, and a node refuses a relative data-dir."""
    from fedvlm.deploy.export_folder import main

    monkeypatch.chdir(tmp_path)
    assert main(["--out", "parts", "--num-partitions", "2", "--set", "max-per-class=2", f"cache-dir={cache_dir}"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "data-dir=" in line]
    assert len(said) == 2 and all(f"data-dir='{tmp_path / 'parts'}/" in line for line in said)


def test_every_pretraining_runs_on_the_pinned_threads_whatever_the_process_has(tmp_path, monkeypatch):
    """The thread count decides how reductions split, and so the weights (one thread and two gave
    two fingerprints, docs/results/backbone-kernels.json): a simulated client with one thread that
    pretrains first must make the weights a two-thread server would. Each family's pretraining runs
    on ``PRETRAIN_THREADS``, and the process gets its own count back after."""
    import torch

    from fedvlm.models import embedded_resnet, tiny_clip, tiny_vlm

    seen: dict[str, int] = {}

    def recorder(name, made):
        def fake(*args, **kwargs):
            seen[name] = torch.get_num_threads()
            return made(*args)

        return fake

    monkeypatch.setattr(tiny_clip, "pretrain", recorder("prompt", lambda recipe: tiny_clip.build_tiny_clip(recipe)))
    fake_vlm = recorder("vlm", lambda recipe, out: (out / "recipe.json").write_text("{}"))
    monkeypatch.setattr(tiny_vlm, "pretrain", fake_vlm)
    resnet = next(iter(embedded_resnet.SOURCES))
    made = embedded_resnet.architecture(resnet)
    monkeypatch.setattr(embedded_resnet, "pretrain", recorder("reprogram", lambda recipe: (made, {})))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tiny_clip.load_embedded_clip(tmp_path)
        tiny_vlm.ensure_pretrained(tmp_path)
        embedded_resnet.load_pretrained(resnet, tmp_path)
        assert torch.get_num_threads() == 1  # the process's own count, given back
    finally:
        torch.set_num_threads(before)
    assert seen == dict.fromkeys(("prompt", "vlm", "reprogram"), prepare.PRETRAIN_THREADS)
    assert prepare.PRETRAIN_THREADS == 2  # the count the published weights were made with
