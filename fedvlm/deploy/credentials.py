"""Credentials for a real federation: a CA, the SuperLink's TLS certificate, SuperNode keys.

    python -m fedvlm.deploy.credentials --out ~/fedvlm-credentials \\
        --server-name superlink.example.org --server-ip 10.0.0.5 --supernode org-a --supernode org-b

writes

    <out>/ca.crt  ca.key            the federation's own certificate authority (ca.key: 0600)
    <out>/server.crt  server.key    the SuperLink's TLS certificate, signed by the CA, valid for
                                    every --server-name / --server-ip given (subject alternative
                                    names: a SuperNode checks the address it dials against them)
                                    and always for localhost and 127.0.0.1: the SuperLink's own
                                    ServerApp process, the Fleet gateway and a researcher on the
                                    host (or through an SSH tunnel) dial it there
    <out>/server-signing.key        the ServerApp's instruction signing key (Ed25519, 0600): stays on
    <out>/server-signing.pub        the SuperLink host; every organisation pins the public one
                                    (deploy.instruction_signing, pinned_app exec --server-key)
    <out>/supernodes/<name>         a SuperNode's authentication key (EC P-384, OpenSSH format,
                                    0600): stays on that SuperNode's machine
    <out>/supernodes/<name>.pub     its public key: the researcher registers it with
                                    `flwr supernode register`
    <out>/supernodes/<name>.identity        the organisation's identity key for secure aggregation
    <out>/supernodes/<name>.identity.pub    (Ed25519, 0600; secagg.roster): it signs the keys its node
                                    advertises in a secure round; stays on that SuperNode's machine
    <out>/roster.json               every organisation's identity public key: each organisation pins
                                    it (node config secure-aggregation-roster) after checking its
                                    digest with the others (python -m fedvlm.secagg.roster show),
                                    and the ServerApp relays for it (secure-aggregation.roster)

Run it again with new --supernode names to add organisations later: an existing CA and server
certificate are reused, existing keys are never overwritten (use --force to reissue the server
certificate, e.g. for a new address). The CA key signs nothing else: keep it offline.

Only ca.crt, server.crt/server.key, server-signing.key and roster.json go to the SuperLink machine;
only ca.crt, server-signing.pub, roster.json and its own two keys to a SuperNode. Nothing here is ever committed (the
repository's .gitignore excludes the usual output folders and key files).
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import re
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedvlm.deploy import instruction_signing as signing
from fedvlm.secagg import roster
from fedvlm.secagg.roster import Roster

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class CredentialsError(ValueError):
    pass


def _write_private(path: Path, data: bytes) -> None:
    """Create ``path`` readable by its owner only, from the first byte (no chmod race), in a
    folder only its owner may enter."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_public(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(0o644)


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def make_ca(out: Path, days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedvlm federation CA")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - dt.timedelta(minutes=5))
        .not_valid_after(_now() + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA384())
    )
    _write_private(out / "ca.key", _pem_key(key))
    _write_public(out / "ca.crt", cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def load_ca(out: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    except (OSError, ValueError) as err:
        raise CredentialsError(f"{out / 'ca.crt'} cannot be read ({err}): restore it from a backup") from err
    try:
        key = serialization.load_pem_private_key((out / "ca.key").read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as err:
        raise CredentialsError(f"{out / 'ca.key'} cannot be read ({err}): restore it from a backup") from err
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CredentialsError(f"{out / 'ca.key'} is not the EC key this command writes: restore the CA's own key")
    return cert, key


def _check_node_name(name: str) -> None:
    if not NAME_RE.match(name):
        raise CredentialsError(f"SuperNode name {name!r} must be 1-64 letters, digits, '.', '_' or '-'")


MAX_DAYS = 3650  # ten years: far past any federation's life, well inside what a certificate's dates can hold


def check_arguments(out: Path, names: list[str], ips: list[str], supernodes: list[str], days: int) -> None:
    """Every argument checked before anything is written (a bad one used to stop the command after
    the CA and the server's key were already in ``out``)."""
    if out.exists() and not out.is_dir():
        raise CredentialsError(f"--out {out} is a file: name a folder (it is made if missing)")
    if not 1 <= days <= MAX_DAYS:
        raise CredentialsError(f"--days {days}: certificates must be valid for 1 to {MAX_DAYS} days")
    for name in names:
        if not name or not all(NAME_RE.match(part) for part in name.split(".")):
            raise CredentialsError(f"--server-name {name!r} is not a host name (letters, digits, '-', dots)")
    for ip in ips:
        try:
            ipaddress.ip_address(ip)
        except ValueError as e:
            raise CredentialsError(
                f"--server-ip {ip!r} is not an IP address ({e}); put host names in --server-name"
            ) from e
    for name in supernodes:
        _check_node_name(name)


# The SuperLink talks to itself on loopback (its ServerApp process, the Fleet gateway, a
# researcher's SSH tunnel): its certificate must be valid there whatever else it names.
LOOPBACK_NAMES, LOOPBACK_IPS = ("localhost",), ("127.0.0.1",)


def make_server_cert(out: Path, ca_cert, ca_key, names: list[str], ips: list[str], days: int) -> x509.Certificate:
    names = [*names, *(n for n in LOOPBACK_NAMES if n not in names)]
    ips = [*ips, *(i for i in LOOPBACK_IPS if i not in ips)]
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]  # checked (check_arguments)
    key = ec.generate_private_key(ec.SECP384R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, (names or ips)[0])])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - dt.timedelta(minutes=5))
        .not_valid_after(_now() + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    _write_private(out / "server.key", _pem_key(key))
    _write_public(out / "server.crt", cert.public_bytes(serialization.Encoding.PEM))
    return cert


def make_supernode_key(out: Path, name: str) -> Path:
    """An EC P-384 key pair in OpenSSH format (what flower-supernode and `flwr supernode register` read)."""
    _check_node_name(name)
    key = ec.generate_private_key(ec.SECP384R1())
    priv = out / "supernodes" / name
    _write_private(
        priv,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ),
    )
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    _write_public(priv.with_suffix(".pub"), pub + f" {name}\n".encode())
    return priv


def generate(
    out: Path,
    server_names: list[str],
    server_ips: list[str],
    supernodes: list[str],
    days: int = 365,
    force: bool = False,
) -> dict[str, list[str]]:
    """Create what is missing under ``out``; returns what was created and what was kept."""
    out = Path(out).expanduser()
    check_arguments(out, server_names, server_ips, supernodes, days)
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    made, kept = [], []
    if (out / "ca.crt").exists() != (out / "ca.key").exists():
        raise CredentialsError(
            f"{out} holds only one of ca.crt and ca.key: restore the other or remove both to start a new CA"
        )
    if (out / "ca.crt").exists():
        ca_cert, ca_key = load_ca(out)
        kept.append("ca.crt")
    else:
        ca_cert, ca_key = make_ca(out, days)
        made.append("ca.crt")
    if force or not (out / "server.crt").exists():
        make_server_cert(out, ca_cert, ca_key, server_names, server_ips, days)
        made.append("server.crt")
    else:
        kept.append("server.crt")
    if (out / "server-signing.key").exists():
        kept.append("server-signing.key")
    else:
        (out / "server-signing.pub").unlink(missing_ok=True)  # a public key without its private one
        signing.generate(out / "server-signing.key", out / "server-signing.pub")
        made.append("server-signing.key")
    for name in supernodes:
        if (out / "supernodes" / name).exists():
            kept.append(f"supernodes/{name}")
        else:
            make_supernode_key(out, name)
            made.append(f"supernodes/{name}")
        identity = out / "supernodes" / f"{name}.identity"
        if identity.exists():
            kept.append(f"supernodes/{name}.identity")
        else:
            identity.with_suffix(".identity.pub").unlink(missing_ok=True)  # a public key without its private one
            roster.generate(identity, identity.with_suffix(".identity.pub"))
            made.append(f"supernodes/{name}.identity")
    write_roster(out)
    return {"created": made, "kept": kept}


def write_roster(out: Path) -> Roster:
    """``<out>/roster.json``: every organisation's identity public key in ``<out>/supernodes``."""
    members = {}
    for public in sorted((out / "supernodes").glob("*.identity.pub")):
        members[public.name.removesuffix(".identity.pub")] = roster.read_public(public)
    made = Roster(members)
    made.write(out / "roster.json")
    return made


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedvlm.deploy.credentials", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="folder for the credentials (created 0700)")
    p.add_argument("--server-name", action="append", default=[], help="DNS name of the SuperLink (repeatable)")
    p.add_argument("--server-ip", action="append", default=[], help="IP address of the SuperLink (repeatable)")
    p.add_argument(
        "--supernode", action="append", default=[], help="name of a SuperNode to make a key for (repeatable)"
    )
    p.add_argument("--days", type=int, default=365, help="validity of the certificates")
    p.add_argument("--force", action="store_true", help="reissue the SuperLink certificate (keeps the CA and the keys)")
    args = p.parse_args(argv)
    try:
        done = generate(args.out, args.server_name, args.server_ip, args.supernode, args.days, args.force)
    except CredentialsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = args.out.expanduser()
    for what in done["created"]:
        print(f"created {out / what}")
    for what in done["kept"]:
        print(f"kept    {out / what} (exists)")
    made = Roster.load(out / "roster.json")
    print(f"roster.json: {len(made.members)} members, digest {made.digest} (compare it with every organisation)")
    print(
        f"The SuperLink certificate is valid for {', '.join([*args.server_name, *args.server_ip])}"
        f"{' and ' if args.server_name or args.server_ip else ''}localhost and 127.0.0.1 (the SuperLink dials itself "
        "there). "
        f"SuperLink machine: {out}/ca.crt, server.crt, server.key, server-signing.key, roster.json. "
        f"Each SuperNode: {out}/ca.crt, server-signing.pub, roster.json and its supernodes/<name> and "
        "<name>.identity. Keep ca.key offline."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
