"""Deployment files: credentials (deploy.credentials), Docker and Compose files."""

from __future__ import annotations

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

ROOT = Path(__file__).resolve().parents[2]
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
    before = {p: (out / p).read_bytes() for p in ("ca.crt", "ca.key", "server.crt", "supernodes/org-a")}
    done = generate(out, ["localhost"], [], ["org-a", "org-c"])
    assert done["created"] == ["supernodes/org-c"] and set(done["kept"]) == {"ca.crt", "server.crt", "supernodes/org-a"}
    assert all((out / p).read_bytes() == b for p, b in before.items())
    server = x509.load_pem_x509_certificate((out / "server.crt").read_bytes())
    server.verify_directly_issued_by(x509.load_pem_x509_certificate((out / "ca.crt").read_bytes()))


def test_credentials_refuse_bad_input(tmp_path):
    with pytest.raises(CredentialsError, match="not an IP address"):
        generate(tmp_path / "a", ["localhost"], ["superlink.example.org"], [])
    only_loopback = generate(tmp_path / "b", [], [], [])  # a SuperLink reached on its host only
    assert only_loopback["created"] == ["ca.crt", "server.crt"]
    with pytest.raises(CredentialsError, match="must be 1-64 letters"):
        generate(tmp_path / "c", ["localhost"], [], ["../escape"])
    generate(tmp_path / "d", ["localhost"], [], [])
    (tmp_path / "d" / "ca.key").unlink()
    with pytest.raises(CredentialsError, match="only one of ca.crt and ca.key"):
        generate(tmp_path / "d", ["localhost"], [], [])


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
