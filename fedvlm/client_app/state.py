"""A node's private state in ``context.state``, which Flower keeps per node across rounds in
simulation and deployment alike. Private tensors live under one ArrayRecord, bookkeeping
under one ConfigRecord, an audited node's canaries under another ArrayRecord; none is ever put
in a reply (the send guard checks)."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

PRIVATE = "private"
META = "meta"
AUDIT = "audit"  # the audited node's canaries (privacy.canaries): secret, never in a reply


def load_private(state: RecordDict, key: str = PRIVATE) -> dict[str, torch.Tensor]:
    if key not in state:
        return {}
    record = state[key]
    assert isinstance(record, ArrayRecord)  # save_private writes one
    return {k: v.clone() for k, v in record.to_torch_state_dict().items()}


def save_private(state: RecordDict, tensors: dict[str, torch.Tensor], key: str = PRIVATE) -> None:
    state[key] = ArrayRecord({k: v.detach().cpu().contiguous() for k, v in tensors.items()})


def load_meta(state: RecordDict) -> dict:
    return dict(state[META]) if META in state else {}


def save_meta(state: RecordDict, meta: dict) -> None:
    state[META] = ConfigRecord(meta)


def optimizer_tensors(opt: torch.optim.Optimizer, prefix: str = "opt.") -> dict[str, torch.Tensor]:
    """The per-parameter optimiser state (momentum, Adam moments) as named tensors."""
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
