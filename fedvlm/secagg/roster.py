"""Who may take part in a secure round: the federation's members and their identity keys.

A roster names each member organisation and the public half of its identity key (Ed25519,
made by ``deploy.credentials``); each organisation pins the roster file on its own machine, as it
pins the app and the server's instruction key. In a secure round every node signs the public keys
it advertises with its identity key, and every node refuses keys that no rostered member signed,
or two nodes signed by one member: the SuperLink host can then relay keys, but cannot make up
clients of its own (Sybils) to surround one real node and unmask it.

A simulation builds its roster from its nodes (``simulated``): member ``sim-<partition id>``,
its key derived from the run's seed. Every party can derive every key, so it protects nothing;
it runs the same protocol, signatures included, as a deployment does.

The file, ``roster.json``::

    {"format": "fedvlm-roster-v1", "members": {"org-a": "<64 hex digits>", ...}}

Its digest (SHA-256 of that object in canonical JSON) names it: the server's round plan states
the roster it relays for, and a node pinned to another refuses the round with both digests.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fedvlm.errors import PublicError

FORMAT = "fedvlm-roster-v1"
KEY_BYTES, SIGNATURE_BYTES = 32, 64
SIMULATED_PREFIX = "sim-"


class RosterError(PublicError, ValueError):
    """A roster or identity key that cannot be used; the message names the file and the fix."""


def public_bytes(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def verify(public: bytes, message: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is the signature of ``message`` by the raw Ed25519 key ``public``."""
    if not (isinstance(public, bytes) and len(public) == KEY_BYTES and isinstance(signature, bytes)):
        return False
    return _verified(public, bytes(message), signature)


@functools.lru_cache(maxsize=1 << 14)
def _verified(public: bytes, message: bytes, signature: bytes) -> bool:
    """Ed25519's check, once per (key, message, signature) in a process: in a simulation every
    node checks the same adverts and stories (a pure function of its arguments, so a cached
    answer is the answer)."""
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True)
class Roster:
    members: Mapping[str, bytes]  # member name -> raw Ed25519 public key

    def __post_init__(self) -> None:
        keys = list(self.members.values())
        if len(set(keys)) != len(keys):
            raise RosterError("two members of the roster share one identity key")
        if any(not isinstance(k, bytes) or len(k) != KEY_BYTES for k in keys):
            raise RosterError(f"a roster key is not {KEY_BYTES} bytes (a raw Ed25519 public key)")

    def as_json(self) -> dict:
        return {"format": FORMAT, "members": {name: self.members[name].hex() for name in sorted(self.members)}}

    @property
    def digest(self) -> str:
        text = json.dumps(self.as_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def member(self, public: bytes) -> str | None:
        """The member whose identity key ``public`` is (None: no rostered member's)."""
        return next((name for name, key in self.members.items() if key == public), None)

    def write(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.as_json(), indent=1, sort_keys=True) + "\n")
        Path(path).chmod(0o644)

    @classmethod
    def load(cls, path: Path) -> Roster:
        path = Path(path).expanduser()
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as why:
            raise RosterError(f"cannot read the roster {path}: {why}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("members"), dict):
            raise RosterError(
                f"{path} is not a roster ({FORMAT}): make one with python -m fedvlm.deploy.credentials --member ..."
            )
        try:
            members = {str(name): bytes.fromhex(str(key)) for name, key in data["members"].items()}
        except ValueError:
            raise RosterError(f"{path}: a member's key is not hexadecimal") from None
        return cls(members)

    @classmethod
    def simulated(cls, seed: int, members: int) -> Roster:
        return cls({_simulated_name(i): public_bytes(_simulated_key(seed, i).public_key()) for i in range(members)})


@dataclass(frozen=True)
class Identity:
    """A member's identity key (private), as the node that speaks for it holds it."""

    key: Ed25519PrivateKey

    @property
    def public(self) -> bytes:
        return public_bytes(self.key.public_key())

    def sign(self, message: bytes) -> bytes:
        return self.key.sign(message)

    @classmethod
    def load(cls, path: Path) -> Identity:
        from fedvlm.deploy.instruction_signing import load_private  # owner-only, Ed25519, one reader

        try:
            return cls(load_private(Path(path).expanduser(), "this member's identity key"))
        except (OSError, ValueError) as why:
            raise RosterError(f"cannot use {path} as this member's identity key: {why}") from None

    @classmethod
    def simulated(cls, seed: int, index: int) -> Identity:
        return cls(_simulated_key(seed, index))


def generate(private_path: Path, public_path: Path) -> bytes:
    """A new identity key pair (the private key 0600, the public one 0644, both PEM); returns the
    raw public key."""
    from fedvlm.deploy.instruction_signing import generate as generate_pair

    generate_pair(private_path, public_path)
    return read_public(public_path)


def read_public(path: Path) -> bytes:
    """The raw Ed25519 key of a PEM public key file."""
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError) as why:
        raise RosterError(f"cannot read the identity public key {path}: {why}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise RosterError(f"{path} is not an Ed25519 public key (make one with python -m fedvlm.deploy.credentials)")
    return public_bytes(key)


def main(argv: list[str] | None = None) -> int:
    """``show ROSTER``: its members, their key fingerprints and its digest, for the organisations
    to compare before each pins it; ``build NAME=PUBLIC_KEY ... --out ROSTER``: a roster from
    identity public keys the organisations made themselves (``deploy.credentials``)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m fedvlm.secagg.roster", description=main.__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show")
    show.add_argument("roster", type=Path)
    build = sub.add_parser("build")
    build.add_argument("members", nargs="+", metavar="NAME=PUBLIC_KEY")
    build.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        if args.command == "build":
            pairs = [m.split("=", 1) for m in args.members]
            if any(len(pair) != 2 for pair in pairs):
                raise RosterError("give each member as NAME=PATH_TO_ITS_IDENTITY_PUBLIC_KEY")
            Roster({name: read_public(Path(path)) for name, path in pairs}).write(args.out)
        made = Roster.load(args.out if args.command == "build" else args.roster)
    except RosterError as why:
        print(f"error: {why}")
        return 2
    for name, key in sorted(made.members.items()):
        print(f"{name}\t{hashlib.sha256(key).hexdigest()[:16]}")
    print(f"digest\t{made.digest}")
    return 0


def _simulated_name(index: int) -> str:
    return f"{SIMULATED_PREFIX}{index}"


@functools.cache  # a simulation's ClientApp builds its roster for every message
def _simulated_key(seed: int, index: int) -> Ed25519PrivateKey:
    raw = hashlib.sha256(f"fedvlm simulated member {int(seed)} {int(index)}".encode()).digest()
    return Ed25519PrivateKey.from_private_bytes(raw)


if __name__ == "__main__":
    raise SystemExit(main())
