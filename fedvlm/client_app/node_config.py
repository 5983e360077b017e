"""A node's own settings (its SuperNode's ``--node-config``), checked in one place before the
node does anything for a run.

- A key the node does not know is refused, with the nearest known one: a typo such as
  ``stat-dir`` once kept a deployed node's private state (its local prompts, its optimiser, its
  ledger) in memory only, silently.
- A folder must be an absolute path (``~`` expanded): a relative one names another folder for
  each directory the SuperNode happens to be started from. ``state-dir`` must be a folder (or
  not exist yet): a file there was admitted and failed every round.
- A number must read as one: ``partition-id='abc'`` failed deep inside the data loader.

Each key is owned (and spelled) by the module that reads it; ``KEYS`` only gathers them.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from pathlib import Path

from fedvlm.client_app.node_policy import CACHE_DIR, DATA_ROOT, MODELS, TRUST_REMOTE_CODE
from fedvlm.client_app.privacy_floor import DELTA, MAX_EPSILON
from fedvlm.client_app.state import STATE_DIR
from fedvlm.privacy.mechanisms import NOISE_SOURCE
from fedvlm.protocol import (
    FALSE_WORDS,
    NODE_WORKER,
    NUM_PARTITIONS,
    PARTITION_ID,
    PUBLISH_DIR,
    REQUIRE_SECURE,
    SECURE_IDENTITY,
    SECURE_MIN_CLIENTS,
    SECURE_ROSTER,
    TRUE_WORDS,
)
from fedvlm.runconfig import ConfigError

NAME, DATA_DIR = "name", "data-dir"

# key -> what its value must be: "int" (a whole number), "number" (finite), "bool" (true or
# false), "path" (an absolute path), "folder" (an absolute path that is a folder where it
# exists), "text"
KEYS: dict[str, str] = {
    PARTITION_ID: "int",
    NUM_PARTITIONS: "int",
    NAME: "text",
    DATA_DIR: "folder",
    STATE_DIR: "folder",
    CACHE_DIR: "folder",
    PUBLISH_DIR: "folder",
    DATA_ROOT: "folder",
    NODE_WORKER: "path",
    MAX_EPSILON: "number",
    DELTA: "number",
    NOISE_SOURCE: "text",
    MODELS: "text",
    TRUST_REMOTE_CODE: "text",
    REQUIRE_SECURE: "bool",
    SECURE_MIN_CLIENTS: "int",
    SECURE_ROSTER: "path",
    SECURE_IDENTITY: "path",
}


def check_node_config(node_config: Mapping) -> None:
    """``ConfigError`` naming the first key of ``node_config`` that is unknown or has a value its
    reader cannot use, and how to fix it."""
    for key, value in node_config.items():
        kind = KEYS.get(str(key))
        if kind is None:
            near = difflib.get_close_matches(str(key), KEYS, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ConfigError(
                f"node config {str(key)[:64]!r} is not a key this node knows: {hint}the keys: {', '.join(sorted(KEYS))}"
            )
        if value is None or value == "":
            continue
        if kind == "int" and (isinstance(value, bool) or not _reads_as(int, value)):
            raise ConfigError(f"node config {key} = {value!r} is not a whole number: write e.g. {key}=0")
        if kind == "bool" and str(value).strip().lower() not in (*TRUE_WORDS, *FALSE_WORDS):
            raise ConfigError(f"node config {key} = {value!r} is not true or false: write e.g. {key}=true")
        if kind == "number" and not (_reads_as(float, value) and math.isfinite(float(value))):
            raise ConfigError(f"node config {key} = {value!r} is not a finite number")
        if kind in ("path", "folder"):
            path = Path(str(value)).expanduser()
            if not path.is_absolute():
                raise ConfigError(
                    f"node config {key} = {value!r} is a relative path, which names another folder for each directory "
                    f"the SuperNode is started from: give the absolute path, e.g. {key}='{Path(str(value)).resolve()}'"
                )
            if kind == "folder" and path.exists() and not path.is_dir():
                raise ConfigError(f"node config {key} = {value!r} is a file, not a folder: name a folder")


def _reads_as(kind: type, value) -> bool:
    try:
        kind(value)
    except (TypeError, ValueError):
        return False
    return kind is not int or float(value) == int(value)
