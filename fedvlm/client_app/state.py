"""A node's private state: in ``context.state`` between messages, and on the node's own disk
after every round, so that it survives a SuperNode restart and a resumed run.

In memory: ``context.state``, which Flower keeps per node across the rounds of one run, in
simulation and deployment alike. Private tensors live under one ArrayRecord, bookkeeping under
one ConfigRecord, an audited node's canaries under another ArrayRecord; none is ever put in a
reply (the send guard checks).

On disk (``state_dir``): the node config's ``state-dir`` (a deployed organisation chooses it)
holds ``<run folder>/<node name>/``, where the run folder is one safe path component made from
the server's run folder (``run_folder``: its name and a digest of its whole path, so nothing the
server sends leads outside the state-dir); a simulated node (one with a partition id) keeps it
under the run folder the server names (``nodes/<node name>/``); a deployed node without
``state-dir`` keeps its state in memory only, and a restart loses it: the run folder is a path
on the server's machine, and a real node never writes its private state where the server (or a
path the server names) says. After a message that changed the state, the node writes
``round-NNNN.pt`` (owner-only: directory 0700, file 0600) and keeps the two newest. A message of
round r restores the newest snapshot the server's last completed round can have left (before r
for training, up to r for evaluation) when the node holds nothing in memory, or holds a state
ahead of that: a run killed in round r + 1 resumes from round r, and the node's snapshot of the
unfinished round r + 1 is not used. The run's privacy ledger of a node without a state-dir
(``client_app.privacy_floor``) and its record of the secure sums it keyed (``SECURE_KEYED``) are
the exception: what the node released in round r + 1 did leave it, so they always come from the
newest snapshot. A node with a state-dir keeps its ledger
beside the runs' folders, across every run.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedvlm.utils.files import UnreadableFile, atomic_torch_save, load_saved
from fedvlm.utils.runtime import simulated

if TYPE_CHECKING:  # torch is imported where a tensor is handled, so that a message without one starts fast
    import torch

PRIVATE = "private"
META = "meta"
AUDIT = "audit"  # the audited node's canaries (privacy.canaries): secret, never in a reply
LEDGER = "node-ledger"  # what the node released (client_app.privacy_floor): never rolled back
HELD = "held"  # which round the state in memory is from, and whether it changed since written
# a secure round's secrets (client_app.secure_aggregation): in memory only, never in a snapshot, so that a
# node's disk never holds a key that unmasks it; a node that restarts mid-round drops out of it
SECURE_ROUND = "secure-round"
# the last round this node keyed a secure sum in, and under which plan (client_app.secure_aggregation):
# never rolled back, like the ledger, since a second session of a round, or one of an earlier round,
# would put the same update into two sums whose difference is that update
SECURE_KEYED = "secure-keyed"
NEVER_ROLLED_BACK = (LEDGER, SECURE_KEYED)
STATE_DIR = "state-dir"  # the node config key
KEEP = 2  # snapshots kept: the newest, and the one before it (see the module docstring)


def load_private(state: RecordDict, key: str = PRIVATE) -> dict[str, torch.Tensor]:
    if key not in state:
        return {}
    record = state[key]
    assert isinstance(record, ArrayRecord)  # save_private writes one
    return {k: v.clone() for k, v in record.to_torch_state_dict().items()}


def _same(record, tensors: dict[str, torch.Tensor]) -> bool:
    import torch

    old = record.to_torch_state_dict()
    return old.keys() == tensors.keys() and all(
        old[k].dtype == v.dtype and old[k].shape == v.shape and torch.equal(old[k], v) for k, v in tensors.items()
    )


def save_private(state: RecordDict, tensors: dict[str, torch.Tensor], key: str = PRIVATE) -> None:
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    if key in state and _same(state[key], tensors) or key not in state and not tensors:
        return  # unchanged (nothing kept reads back as nothing): nothing new to write to disk either
    state[key] = ArrayRecord(tensors)
    _mark_changed(state)


def load_secure(state: RecordDict, part: str = "") -> dict:
    """A part of the node's secure round in progress (``client_app.secure_aggregation``), or nothing."""
    record = state.get(SECURE_ROUND + part)
    return dict(record) if isinstance(record, ConfigRecord) else {}


def save_secure(state: RecordDict, values: dict, part: str = "") -> None:
    state[SECURE_ROUND + part] = ConfigRecord(dict(values))


def clear_secure(state: RecordDict) -> None:
    for key in [k for k in state.keys() if k.startswith(SECURE_ROUND)]:
        del state[key]


def load_meta(state: RecordDict, key: str = META) -> dict:
    return dict(state[key]) if key in state else {}


def save_meta(state: RecordDict, meta: dict, key: str = META) -> None:
    if key in state and dict(state[key]) == meta:
        return
    state[key] = ConfigRecord(meta)
    _mark_changed(state)


def optimizer_tensors(opt: torch.optim.Optimizer, prefix: str = "opt.") -> dict[str, torch.Tensor]:
    """The per-parameter optimiser state (momentum, Adam moments) as named tensors."""
    import torch

    out = {}
    for pid, pstate in opt.state_dict()["state"].items():
        for k, v in pstate.items():
            out[f"{prefix}{pid}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
    return out


def restore_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], prefix: str = "opt.") -> None:
    sd = opt.state_dict()
    state: dict[int, dict] = {}
    for name, v in tensors.items():
        if not name.startswith(prefix):
            continue
        pid, key = name[len(prefix) :].split(".", 1)
        state.setdefault(int(pid), {})[key] = v
    if state:
        sd["state"] = state
        opt.load_state_dict(sd)


# ---- on disk ---------------------------------------------------------------------------------
def _held_round(state: RecordDict) -> int | None:
    """The round the state in memory is from (None: nothing held since the process started)."""
    if HELD not in state:
        return None
    held = state[HELD]["round"]
    assert isinstance(held, int)  # written by this module
    return held


def _mark_changed(state: RecordDict) -> None:
    state[HELD] = ConfigRecord({"round": _held_round(state) or 0, "changed": True})


def run_folder(run_dir: str) -> str:
    """The folder a node with a state-dir keeps a run's state in: one path component the server
    cannot steer out of the state-dir (its run folder's last part, made safe, and a digest of the
    whole path, so that '..', '/' or two servers' same-named folders never meet)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", PurePosixPath(run_dir.replace("\\", "/")).name).strip("._")[:64]
    return f"{name or 'run'}-{hashlib.sha256(run_dir.encode()).hexdigest()[:12]}"


def state_dir(node_config: dict, run_dir: str, partition_id: int, name: str) -> Path | None:
    """Where this node keeps its state on disk for the run in ``run_dir`` (module docstring)."""
    if not run_dir:
        return None
    if node_config.get(STATE_DIR):
        return Path(str(node_config[STATE_DIR])).expanduser() / run_folder(run_dir) / name
    if partition_id >= 0 and simulated():
        return Path(run_dir) / "nodes" / name
    return None


def _snapshots(where: Path) -> dict[int, Path]:
    if not where.is_dir():
        return {}
    found = (re.fullmatch(r"round-(\d+)", p.stem) for p in where.glob("round-*.pt"))  # not round-0003-bak.pt
    return {int(m.group(1)): where / f"{m.group(0)}.pt" for m in found if m}


def restore(state: RecordDict, where: Path | None, server_round: int, training: bool) -> int | None:
    """Bring ``state`` to the node's newest snapshot a message of ``server_round`` may build on
    when memory holds none, or one ahead of it; the snapshot's round (None: memory kept)."""
    if where is None or server_round <= 0:
        return None
    newest = server_round - 1 if training else server_round
    held = _held_round(state)
    if held is not None and held <= newest:
        return None
    snapshots = _snapshots(where)
    if not snapshots and where.is_dir() and not any(where.glob(".round-*")):
        # persist made the folder with this run's first snapshot and always keeps KEEP of them (a
        # temporary file left over is a first snapshot that was never written, and its reply never
        # left): an empty folder lost its snapshots, and starting afresh would be silent
        raise UnreadableFile(
            f"{where} held this node's private state for this run, but its snapshots (round-NNNN.pt) are gone: "
            f"restore them from a backup, or remove the folder {where} to start this node afresh in this run"
        )
    usable = {r: p for r, p in snapshots.items() if r <= newest}
    kept = {key: state.get(key) for key in NEVER_ROLLED_BACK}
    if snapshots and None in kept.values():
        newest_saved = _records(_load_snapshot(snapshots[max(snapshots)]))
        kept = {key: record if record is not None else newest_saved.get(key) for key, record in kept.items()}
    for key in list(state.keys()):
        del state[key]
    restored = None
    if usable:  # else a node that never trained before this round: it starts afresh
        saved = _load_snapshot(usable[max(usable)])
        for key, record in _records(saved).items():
            state[key] = record
        restored = int(saved["round"])
    for key, record in kept.items():
        if record is not None:
            state[key] = record
    state[HELD] = ConfigRecord({"round": restored or 0, "changed": any(r is not None for r in kept.values())})
    return restored


def _load_snapshot(path: Path) -> dict:
    # No falling back to an older snapshot: its privacy ledger would forget what was released since.
    fix = "this node's private state cannot be restored; restore the file from a backup, or start a new run"
    saved = load_saved(path, fix)
    records = saved.get("records") if isinstance(saved, dict) else None
    if (
        not isinstance(records, dict)
        or not isinstance(saved.get("round"), int)
        or not all(
            isinstance(r, tuple | list) and len(r) == 2 and r[0] in ("arrays", "config") for r in records.values()
        )
    ):
        raise UnreadableFile(f"{path} is not a snapshot of a node's state (its round and records): {fix}")
    return saved


def _records(saved: dict) -> dict:
    return {
        k: ArrayRecord(data) if kind == "arrays" else ConfigRecord(data) for k, (kind, data) in saved["records"].items()
    }


def persist(state: RecordDict, where: Path | None, server_round: int) -> Path | None:
    """Write ``state`` as of ``server_round`` if a message changed it; keep the ``KEEP`` newest."""
    if where is None or HELD not in state or not state[HELD].get("changed"):
        return None
    records: dict[str, tuple[str, dict]] = {}
    for key, record in state.items():
        if key == HELD or key.startswith(SECURE_ROUND):
            continue
        if isinstance(record, ArrayRecord):
            records[key] = ("arrays", record.to_torch_state_dict())
        else:
            records[key] = ("config", dict(record))
    where.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(where, 0o700)  # mkdir's mode is masked by the umask; the state is the node's alone
    path = where / f"round-{server_round:04d}.pt"
    # written 0600 (mkstemp), with a digest: a damaged snapshot is refused, not restored as other numbers
    atomic_torch_save({"round": server_round, "records": records}, path, digest=True)
    state[HELD] = ConfigRecord({"round": server_round, "changed": False})
    for _, old in sorted(_snapshots(where).items())[:-KEEP]:
        old.unlink(missing_ok=True)
    return path
