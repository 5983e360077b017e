"""What a deployed node lets the run config choose: never code to import, never a path.

The run config is the server's. On a real node (a SuperNode's ClientApp, ``utils.runtime``) every
key that would make the node load code or touch a path of its own machine is decided by the
node config instead, or by an allow-list there, and a run config that asks otherwise is refused
at the handshake, naming the key (the server excludes the node with that reason):

- the models the node loads (``clip.model`` with ``clip.pretrained``, ``vlm.model``,
  ``reprogram.source-weights``): the embedded ones (built by this project's code), open_clip's
  own architectures with its published pretrained tags, and torchvision's ImageNet weights are
  always allowed: the installed libraries' code and their published, hash-checked weights.
  Anything else must be named in the node config's ``models``, a comma-separated list of
  ``NAME`` (a hub id the node may download from its hub: ``vlm.model`` or an ``hf-hub:``
  ``clip.model``) or ``NAME=PATH`` with an optional ``#sha256:<hex>`` (the run config names
  NAME; the node loads its own PATH, a file checked against the hash before it is read, or a
  folder). A path in the run config is never opened on a real node: ``clip.pretrained='/x.pt'``
  is refused unless ``/x.pt`` is itself a NAME in ``models``.
- ``vlm.trust-remote-code = true`` runs the model's own Python: only with the node config's
  ``trust-remote-code = true``, and only for a model named in ``models``.
- ``data-root``, ``download`` and ``vlm.ood-captions`` read or write the node's disk: refused
  (the node's data is its node config's ``data-dir``, or a partition of the dataset under its
  node config's ``data-root``).
- where the node caches features of its private images and pretrained weights is its node
  config's ``cache-dir`` (else ``$FEDVLM_CACHE`` or ``~/.cache/fedvlm``): the run config's
  ``cache-dir`` is the ServerApp's and the simulation's, and a real node never uses it; where it
  keeps its state is its node config's ``state-dir`` (``client_app.state`` names the run's folder
  inside it, one path component the server cannot steer).

A simulated node runs on the researcher's own machine with the researcher's config: nothing to
refuse there.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass, replace
from pathlib import Path

from fedvlm.runconfig import DEFAULTS, ConfigError, RunConfig
from fedvlm.utils.paths import default_cache_dir
from fedvlm.utils.runtime import simulated

MODELS, TRUST_REMOTE_CODE, CACHE_DIR, DATA_ROOT = "models", "trust-remote-code", "cache-dir", "data-root"
EMBEDDED = ("embedded-tiny", "embedded-tiny-vlm")  # built by this project's own code
SOURCE_WEIGHTS = ("auto", "imagenet", "random")  # torchvision's published weights, or none
_ENTRY = re.compile(r"^(?P<name>[^=#]+?)\s*(?:=\s*(?P<path>[^#]+?)\s*(?:#\s*sha256:(?P<sha>[0-9a-fA-F]{64}))?)?$")


@dataclass(frozen=True)
class AllowedModel:
    """One entry of the node config's ``models``."""

    name: str
    path: Path | None = None  # the node's own copy; None: a hub id the node may download
    sha256: str | None = None  # of the file at ``path``


def allowed_models(node_config: dict) -> dict[str, AllowedModel]:
    """The node config's ``models``, parsed (``ConfigError`` naming a malformed entry)."""
    out: dict[str, AllowedModel] = {}
    for raw in str(node_config.get(MODELS, "") or "").split(","):
        if not raw.strip():
            continue
        m = _ENTRY.match(raw.strip())
        if not m:
            raise ConfigError(
                f"node config {MODELS} entry {raw.strip()!r} is not NAME, NAME=PATH or NAME=PATH#sha256:<64 hex digits>"
            )
        path = Path(m["path"]).expanduser() if m["path"] else None
        if path is not None and not path.is_absolute():
            raise ConfigError(f"node config {MODELS} entry {raw.strip()!r}: give the node's PATH as an absolute path")
        out[m["name"].strip()] = AllowedModel(m["name"].strip(), path, m["sha"].lower() if m["sha"] else None)
    return out


@functools.lru_cache(maxsize=32)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _checked(entry: AllowedModel, key: str) -> str:
    """The node's own file or folder for ``entry``, its hash checked."""
    assert entry.path is not None  # only entries with a path are resolved here
    if not entry.path.exists():
        raise ConfigError(f"node config {MODELS} maps {entry.name!r} to {entry.path}, which does not exist")
    if entry.sha256 is not None:
        if not entry.path.is_file():
            raise ConfigError(f"node config {MODELS}: {entry.path} is a folder; a sha256 can only pin a file")
        st = entry.path.stat()
        got = _file_sha256(str(entry.path), st.st_size, st.st_mtime_ns)
        if got != entry.sha256:
            raise ConfigError(
                f"run config {key!r} = {entry.name!r}: the node's file {entry.path} has sha256 {got}, not the "
                f"{entry.sha256} its node config {MODELS} pins: refusing to load it"
            )
    return str(entry.path)


def _refused(key: str, value: object, why: str) -> ConfigError:
    return ConfigError(f"run config {key!r} = {value!r}: {why}")


def _model(key: str, value: str, allowed: dict[str, AllowedModel], hub_ok: bool) -> str:
    """What the node loads for a run config model reference it does not know as a library's own:
    its own path for a NAME=PATH entry, the hub id for a NAME entry (where a hub id fits)."""
    entry = allowed.get(value)
    if entry is None:
        raise _refused(
            key,
            value,
            f"this node loads only the embedded models, its libraries' published weights and the models its node "
            f"config {MODELS} names ({', '.join(sorted(allowed)) or 'none'}); ask the organisation to add it there "
            f"(NAME=PATH for its own copy)",
        )
    if entry.path is not None:
        return _checked(entry, key)
    if not hub_ok:
        raise _refused(key, value, f"node config {MODELS} names it without a PATH; this key needs the node's own file")
    return value


def _clip(cfg: RunConfig, allowed: dict[str, AllowedModel]) -> RunConfig:
    import open_clip

    name, tag = cfg.clip.model, cfg.clip.pretrained
    if name in EMBEDDED:
        return cfg
    if name not in open_clip.list_models():  # an hf-hub: architecture, its weights from that repository
        if _model("clip.model", name, allowed, hub_ok=True) != name:
            raise _refused("clip.model", name, f"an architecture; its node config {MODELS} entry must have no PATH")
    elif tag and tag not in open_clip.list_pretrained_tags_by_model(name):
        tag = _model("clip.pretrained", tag, allowed, hub_ok=False)
    return replace(cfg, clip=replace(cfg.clip, pretrained=tag))


def _vlm(cfg: RunConfig, node_config: dict, allowed: dict[str, AllowedModel]) -> RunConfig:
    name = cfg.vlm.model
    if cfg.vlm.trust_remote_code and (
        str(node_config.get(TRUST_REMOTE_CODE, "")).lower() != "true" or name not in allowed
    ):
        raise _refused(
            "vlm.trust-remote-code",
            True,
            f"it runs the model's own Python code on this node: only with the node config's {TRUST_REMOTE_CODE}=true "
            f"and a model its {MODELS} names",
        )
    if name not in EMBEDDED:
        name = _model("vlm.model", name, allowed, hub_ok=True)
    return replace(cfg, vlm=replace(cfg.vlm, model=name))


def _source_weights(cfg: RunConfig, allowed: dict[str, AllowedModel]) -> RunConfig:
    weights = cfg.reprogram.source_weights
    if weights in SOURCE_WEIGHTS:
        return cfg
    return replace(
        cfg,
        reprogram=replace(
            cfg.reprogram, source_weights=_model("reprogram.source-weights", weights, allowed, hub_ok=False)
        ),
    )


def node_cache_dir(node_config: dict) -> str:
    """Where a real node caches: its node config's, else ``utils.paths.default_cache_dir``."""
    chosen = node_config.get(CACHE_DIR)
    path = Path(str(chosen)).expanduser() if chosen else default_cache_dir()
    if not path.is_absolute():
        raise ConfigError(f"node config {CACHE_DIR} = {chosen!r}: give an absolute path")
    return str(path)


def for_node(cfg: RunConfig, node_config: dict) -> RunConfig:
    """The run config as this node executes it (the module docstring); ``ConfigError`` naming
    the first key it refuses."""
    if simulated():
        return cfg
    for key, value, why in (
        ("data-root", cfg.data_root, f"this node reads only its node config's data-dir (or {DATA_ROOT})"),
        ("download", cfg.download, "this node downloads no dataset because a run asks"),
        ("vlm.ood-captions", cfg.vlm.ood_captions, "this node reads only its node config's data-dir"),
    ):
        if value != DEFAULTS[key]:
            raise _refused(key, value, why)
    allowed = allowed_models(node_config)
    cfg = _source_weights(_vlm(_clip(cfg, allowed), node_config, allowed), allowed)
    return replace(cfg, cache_dir=node_cache_dir(node_config), data_root=str(node_config.get(DATA_ROOT, "") or ""))
