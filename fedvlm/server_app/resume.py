"""A run's checkpoint, and continuing an interrupted run from it (``resume = '<run dir>'``).

After every round's training the loop writes ``checkpoint.pt`` (atomically): the round, the
shared arrays, and the strategy's ``state_dict`` (its own state, the privacy spent, the ledger).
The round's evaluation goes out with the next round's train messages; until it is back, the
round's record in results.json says ``"evaluated": false``, and a run resumed from there sends
that evaluation first (a node evaluates from its snapshot of that round, ``client_app.state``,
so the figures are the ones the uninterrupted run would have recorded; a run cut off in its
last evaluation is resumed to finish it). A run killed at
any point (the ServerApp, the SuperLink, the machine) continues from its run folder with the
same config; only ``num-server-rounds`` (and the keys below that change nothing computed) may
differ, so a finished run can also be extended. The resumed run writes into the same folder, drops any round
recorded after the checkpoint, and records in ``run.resumed`` when and from which round it went
on. Nodes find their private state in their own state directories (``client_app.state``).

Every draw is keyed by the seed and the round, so a resumed simulation with seeded noise ends
with exactly the numbers and arrays of an uninterrupted run; with OS noise
(``privacy.noise-source``) the noise differs, as it would between any two runs.

A run's folder is locked while its ServerApp runs (``run.lock``, released when that process
ends, however it ends): a resume of a run that is still running is refused, instead of two
ServerApps writing one folder while the nodes restart from fresh private state.

The privacy plan of a resumed run is the interrupted run's (its clients, their sizes and the
global average's denominator, saved with the budget): a node that is not connected any more is
simply not sampled, one that joined since is admitted as a late node, so a federation whose
membership changed can still be resumed with the same config.

A round cut off after its train messages went out may have released the clients' noisy
updates, so the loop notes its trainees first (``inflight.json``). Run again after a resume with
seeded noise, each of them releases the very same tensor (same records, state and noise): the
round is spent once. With OS noise the second release is independent of the first, so the
abandoned round is charged to its trainees' budgets as well (``run.resumed`` says which).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedvlm.runconfig import KEYS, RunConfig, pins
from fedvlm.status import RUN_LOCK, damage
from fedvlm.strategies.base import ResumeError
from fedvlm.strategies.parts import RunParts
from fedvlm.strategies.records import complete
from fedvlm.utils.files import atomic_torch_save, atomic_write_json, load_json, load_saved, read_results, try_hold

CHECKPOINT = "checkpoint.pt"
INFLIGHT = "inflight.json"
# a refused resume, kept beside the run it would have continued: the folder itself is left as it
# was (its results.json still says 'finished'), so without this `flwr run ... resume=... &&
# python -m fedvlm.status` reported success when the resume was refused (fedvlm.status reads it)
REFUSED = "resume-refused.json"
# keys that may differ: how long the run goes on, and keys that never change what it computes
# (where a new run's folder would go, where the caches are: each entry is named by what made it,
# like the embedded CLIP by its recipe; how long to wait for replies)
FREE_KEYS = frozenset(
    {
        "num-server-rounds",
        "resume",
        "output-dir",
        "cache-dir",
        "run-name",
        "round-timeout",
        "backbone-fingerprint",  # a check of the weights, computing nothing: a checkpoint keeps its own
        *(k.name for k in KEYS if k.section == "tracking"),
    }
)


@dataclass
class ResumePoint:
    run_dir: Path
    results: dict  # results.json as the interrupted run left it
    round: int  # the last completed round
    state: dict  # the strategy's state after it
    abandoned: dict | None = None  # the round cut off after its train messages went out: round, trainees
    evaluation_owed: bool = False  # the last completed round's evaluation never came back (the loop sends it)


def hold_run_dir(run_dir: Path):
    """This ServerApp's lock on its run folder (module docstring); ``ResumeError`` if another
    process holds it."""
    held = try_hold(Path(run_dir) / RUN_LOCK)
    if held is None:
        pid = (Path(run_dir) / RUN_LOCK).read_text().strip() or "?"
        raise ResumeError(
            f"{Path(run_dir).name} is still running (its ServerApp, process {pid}, holds {RUN_LOCK}): wait for it, or "
            "stop it (python -m fedvlm.stop) before resuming"
        )
    return held


def save_inflight(run_dir: Path, server_round: int, trainees: list[str]) -> None:
    """Before a round's train messages go out: who is about to release an update."""
    atomic_write_json({"round": server_round, "trainees": trainees}, run_dir / INFLIGHT)


def save_checkpoint(run_dir: Path, state: dict, arrays: dict[str, np.ndarray], server_round: int) -> None:
    """The shared ``arrays`` after round ``server_round`` and the strategy's ``state``: what a
    resumed run continues from."""
    tensors = {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}
    state = {"round": server_round, "arrays": tensors, "state": state}
    atomic_torch_save(state, run_dir / CHECKPOINT, digest=True)  # damage is refused at resume, not resumed from


def config_differences(saved: dict, now: dict) -> list[str]:
    """The keys, outside ``FREE_KEYS``, whose value in a run folder's config (``saved``) is not ``now``'s."""
    now = json.loads(json.dumps(now))  # as results.json holds it (tuples as lists)
    # a key added to fedvlm after the run was made: the run ran as its default says (a new key's
    # default keeps the behaviour from before it), so a run of an older fedvlm still resumes
    saved = {**{k.name: k.default for k in KEYS if k.name not in saved and not k.auto}, **saved}
    keys = sorted((saved.keys() | now.keys()) - FREE_KEYS)
    return [f"{k} = {saved.get(k)!r} (now {now.get(k)!r})" for k in keys if saved.get(k) != now.get(k)]


def resume_point(cfg: RunConfig) -> ResumePoint | None:
    """The interrupted run ``cfg.resume`` names, checked against ``cfg``; None for a new run."""
    if not cfg.resume:
        return None
    run_dir = Path(cfg.resume).expanduser().resolve()
    results = run_dir / "results.json"
    if not results.is_file():
        raise ResumeError(
            f"run config 'resume' = {cfg.resume!r}: {results} does not exist; name the run folder that holds it"
        )
    fix = f"restore it from a backup, or start the run afresh ({run_dir.name} cannot be resumed)"
    data = read_results(run_dir, fix)
    damaged = damage(data)
    if damaged is not None:
        raise ResumeError(f"{results}: {damaged}; {fix}")
    differ = config_differences(data["config"], cfg.as_dict())
    if differ:
        raise ResumeError(
            f"cannot resume {run_dir.name}: its config differs from this one in {len(differ)} key(s): "
            + "; ".join(differ)
            + ". Resume with the run's own config (besides num-server-rounds, only "
            + ", ".join(sorted(FREE_KEYS - {"num-server-rounds"}))
            + " may change)"
        )
    if not (run_dir / CHECKPOINT).is_file():
        raise ResumeError(f"{run_dir.name} never completed a round (no {CHECKPOINT}): start it afresh")
    saved = load_saved(run_dir / CHECKPOINT, fix)
    if not isinstance(saved, dict) or "state" not in saved or "round" not in saved:
        raise ResumeError(f"{run_dir / CHECKPOINT} holds no strategy state (written by an older fedvlm): start afresh")
    began = saved["state"].get("backbone") or (data["run"].get("backbone") or {}).get("fingerprint")
    if not pins(cfg.backbone_fingerprint, began):
        raise ResumeError(
            f"{run_dir.name} began on weights {began or 'it did not record'}, not the pinned "
            f"{cfg.backbone_fingerprint!r}: resume it without backbone-fingerprint where its weights are, or pin those"
        )
    done = int(saved["round"])
    last = [r for r in data["rounds"] if r["round"] == done]
    owed = bool(last) and not complete(last[0])
    if done > cfg.num_server_rounds or done == cfg.num_server_rounds and not owed:
        raise ResumeError(
            f"{run_dir.name} has completed {done} round(s), num-server-rounds is {cfg.num_server_rounds}: nothing to "
            f"resume; raise num-server-rounds to run it further"
        )
    # without it, a round cut off after its messages went out could not be charged to its trainees
    why_inflight = f"restore it from a backup, or start afresh ({run_dir.name} cannot be resumed without it)"
    inflight = load_json(run_dir / INFLIGHT, why_inflight) if (run_dir / INFLIGHT).is_file() else None
    if inflight is not None and not _a_round_in_flight(inflight):
        raise ResumeError(
            f"{run_dir / INFLIGHT} is not a round in flight (a whole-number 'round' and a list of node names, "
            f"'trainees'): {why_inflight}"
        )
    abandoned = inflight if inflight is not None and inflight["round"] > done else None
    return ResumePoint(run_dir, data, done, saved["state"], abandoned, owed)


def _a_round_in_flight(inflight: object) -> bool:
    """What ``save_inflight`` writes: {'round': int, 'trainees': [name, ...]}."""
    if not isinstance(inflight, dict):
        return False
    number, trainees = inflight.get("round"), inflight.get("trainees")
    return (
        isinstance(number, int)
        and not isinstance(number, bool)
        and isinstance(trainees, list)
        and all(isinstance(t, str) for t in trainees)
    )


def charge_abandoned(parts: RunParts, point: ResumePoint) -> dict:
    """Spend the abandoned round on its trainees' budgets where a replay is not the same release
    (module docstring); what was decided, for ``run.resumed``."""
    if point.abandoned is None:
        return {}
    return parts.budget.charge_abandoned(
        point.abandoned["round"], point.abandoned["trainees"], parts.registry.noise_sources()
    )


def note_refused(cfg: RunConfig, why: Exception) -> None:
    """Keep why resuming ``cfg.resume`` was refused in that run folder (where there is one)."""
    run_dir = Path(cfg.resume).expanduser()
    if cfg.resume and run_dir.is_dir():
        atomic_write_json({"at": time.time(), "reason": str(why)[:2000]}, run_dir / REFUSED)


def clear_refused(run_dir: Path) -> None:
    """A resume that went ahead: an earlier refusal no longer describes the folder."""
    (Path(run_dir) / REFUSED).unlink(missing_ok=True)
