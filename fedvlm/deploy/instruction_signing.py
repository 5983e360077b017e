"""A node acts only on instructions its federation's ServerApp signed.

Flower's SuperLink checks that a Fleet request is signed by the key of the node it names, not
who a pushed message claims to be from: in Flower 1.42 an organisation with its own registered
key could push a message "from the SuperLink" to another organisation's node, which would then
train on arrays the attacker chose and spend its privacy budget. The Fleet gateway now refuses
such pushes (``deploy.fleet_gateway``: a node may push only its own replies, to the SuperLink).
This is the end-to-end layer, which holds even where the gateway is bypassed or misconfigured:

- the federation's host keeps an Ed25519 key pair (``deploy.credentials`` makes it:
  ``server-signing.key``, owner-only, and ``server-signing.pub``), and its ServerApp, started
  with ``FEDVLM_SIGNING_KEY`` naming the private key, signs every message it pushes
  (``sign_pushes``);
- an organisation pins the public key beside the app's hash (``pinned_app exec --server-key``),
  and its ClientApp process verifies each message after pulling it and before the pinned app is
  installed, loaded or run (``verify``); an unsigned message, a bad signature or a signature by
  another key ends the task with an error reply, and nothing of the app runs, so nothing is
  trained or spent.

What is signed (``digest``): the run id, the sender and destination node ids, the message type,
the group id (the round), the message's content (Flower's own object id of the content's
RecordDict, a SHA-256 Merkle digest over every record and array, computed again on the node from
what it pulled) and a random nonce of the message's own, under a domain string. A signature
therefore binds a message to one node and one run: it cannot be redirected to another node,
replayed into another run, or have its content changed. Within its run a node serves each
signed message once: it keeps the nonces it served (``Served``, a file per run in the folder
``pinned_app exec --served-dir`` names, owner-only) and refuses a message whose nonce is there,
so a replayed instruction is never trained on or charged to the node's ledger again.
The signature travels in one ConfigRecord of the content (``SIGNATURE``), which the digest leaves
out. Every message gets a content of its own before it is signed, since Flower's strategies may
share one RecordDict between the messages of a round.

This is standard public-key signing (``cryptography``'s Ed25519), not a protocol of our own; what
it does not cover is said in docs/deployment.md's threat model: whoever controls the SuperLink host
holds the key (the ServerApp runs there), and the signature says who sent an instruction, not
that the instruction is honest (the node's own checks do that).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
    from flwr.app import Message

SIGNATURE = "fedvlm.signature"  # the content record that carries the signature
SIGNING_KEY_ENV = "FEDVLM_SIGNING_KEY"  # the ServerApp's private key file, on the SuperLink host
DOMAIN = "fedvlm-instruction-v2"  # v2: the nonce is signed


class UnsignedInstruction(PermissionError):
    """A message this node's pinned ServerApp key did not sign."""


def generate(private_path: Path, public_path: Path) -> None:
    """A new key pair: the private key 0600 (PEM, PKCS#8), the public one beside it, 0644 whatever
    the umask (every organisation's container, another account, reads it)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    Path(public_path).write_bytes(public)
    Path(public_path).chmod(0o644)


def load_private(path: Path, what: str = "the ServerApp's signing key") -> Ed25519PrivateKey:
    """An Ed25519 private key from a file only its owner may read (``what``: whose, for the errors)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(path)
    if stat.S_IMODE(path.stat().st_mode) & 0o077:
        raise PermissionError(f"{path} ({what}) is readable by others: chmod 600 {path}")
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} is not an Ed25519 private key (make one with python -m fedvlm.deploy.credentials)")
    return key


def load_public(path: Path) -> Ed25519PublicKey:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    key = serialization.load_pem_public_key(Path(path).read_bytes())
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{path} is not an Ed25519 public key (the federation's server-signing.pub)")
    return key


def key_id(key: Ed25519PublicKey) -> str:
    from cryptography.hazmat.primitives import serialization

    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def digest(msg: Message, nonce: str) -> bytes:
    """What a signature covers (the module docstring)."""
    from flwr.app import RecordDict

    md = msg.metadata
    content = RecordDict({k: v for k, v in msg.content.items() if k != SIGNATURE})
    fields = [DOMAIN, md.run_id, md.src_node_id, md.dst_node_id, md.message_type, md.group_id, content.object_id, nonce]
    return hashlib.sha256(json.dumps(fields, separators=(",", ":")).encode()).digest()


def signed(msg: Message, key: Ed25519PrivateKey) -> Message:
    """``msg`` with a content of its own that carries its signature and its nonce."""
    from flwr.app import ConfigRecord, RecordDict

    content = RecordDict({k: v for k, v in msg.content.items() if k != SIGNATURE})
    msg.content = content
    nonce = os.urandom(16).hex()
    signature = key.sign(digest(msg, nonce))
    content[SIGNATURE] = ConfigRecord({"key": key_id(key.public_key()), "nonce": nonce, "signature": signature})
    return msg


def check_flower() -> str | None:
    """Why Flower's grids do not send through ``push_messages`` (None: they do): signing wraps
    that one method, so a grid whose ``send_and_receive`` pushed another way would send unsigned."""
    import inspect

    from flwr.superlink.grid.http_grid import HttpGrid
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    for grid in (HttpGrid, InMemoryGrid):
        if "self.push_messages(" not in inspect.getsource(grid.send_and_receive):
            return f"{grid.__name__}.send_and_receive no longer sends through push_messages"
    return None


def sign_pushes(grid: Any, key: Ed25519PrivateKey) -> None:
    """Every message ``grid`` pushes from now on is signed first (Flower's ``send_and_receive``
    and every other sender go through the grid's ``push_messages``)."""
    push: Callable[[Iterable[Message]], Iterable[str]] = grid.push_messages

    def push_signed(messages: Iterable[Message]) -> Iterable[str]:
        return push([signed(m, key) for m in messages])

    grid.push_messages = push_signed


class Served:
    """The nonces of the signed messages a node served, a JSON list per run in ``folder`` (0700),
    each added under an exclusive lock before the app runs: a message seen before is refused."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def once(self, run_id: int, nonce: str, what: str) -> None:
        from fedvlm.utils.files import atomic_write_json, file_lock, load_json

        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.folder / f"run-{int(run_id)}.json"
        with file_lock(path):
            seen = (
                load_json(path, "restore it or move it away (it lists the messages this node served)")
                if path.exists()
                else []
            )
            if not isinstance(seen, list):
                raise UnsignedInstruction(f"{path} is not a list of served messages: restore it or move it away")
            if nonce in seen:
                raise UnsignedInstruction(
                    f"the {what} was served by this node before (nonce {nonce[:12]}...): a replayed instruction is "
                    "refused before the app ran, so it trains nothing and spends nothing"
                )
            atomic_write_json([*seen, nonce], path, durable=True)


def verify(msg: Message, keys: Sequence[Ed25519PublicKey], served: Served | None = None) -> None:
    """``UnsignedInstruction`` unless one of ``keys`` signed ``msg`` as it arrived and, with
    ``served``, this node has not served it before."""
    from cryptography.exceptions import InvalidSignature

    what = f"{msg.metadata.message_type} message of run {msg.metadata.run_id}"
    record = msg.content.get(SIGNATURE) if msg.content is not None else None
    if record is None:
        raise UnsignedInstruction(
            f"the {what} carries no signature: this node acts only on instructions its federation's ServerApp signed "
            f"(key {', '.join(key_id(k) for k in keys)}); refused before the app ran"
        )
    nonce = record.get("nonce")
    body, signature = digest(msg, nonce if isinstance(nonce, str) else ""), record.get("signature")
    for key in keys:
        try:
            key.verify(signature, body)  # type: ignore[arg-type]  # a record's value; not bytes: TypeError
        except (InvalidSignature, TypeError):
            continue
        if served is not None:
            served.once(msg.metadata.run_id, str(nonce), what)
        return
    raise UnsignedInstruction(
        f"the {what} is not signed by this node's pinned ServerApp key ({', '.join(key_id(k) for k in keys)}; "
        f"it names key {record.get('key', '?')}), or was changed after signing: refused before the app ran"
    )


def signing_key_from_env() -> Ed25519PrivateKey | None:
    """The ServerApp's signing key, where its host names one (``FEDVLM_SIGNING_KEY``)."""
    path = os.environ.get(SIGNING_KEY_ENV)
    return load_private(Path(path)) if path else None
