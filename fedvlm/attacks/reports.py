"""The attack reports a run folder holds, read without attacking: each family's file name and its
pooled attacks ({attack: {metric: {"value", "ci95"}}}), for the sweep, the leaderboard and the
run's privacy picture. Nothing here imports the attacks themselves (torch, the models)."""

from __future__ import annotations

import json
from pathlib import Path

MIA = "mia.json"  # the prompt family's (``attacks.run``)
MAXRENYI = "maxrenyi.json"  # the VLM family's (``attacks.maxrenyi``)
GLOBAL = "global_attack.json"  # the reprogramming family's (``attacks.global_model``)
HEADLINE = "alpha=0.5,K=10"  # MaxRényi's setting fixed in advance (``attacks.maxrenyi``)
# what an attack says of a run folder whose results.json it cannot read (``utils.files.read_results``)
ATTACKED = "restore it from a backup: an attack reads the run's config and its members from it"


def prompt_pooled(report: dict) -> dict[str, dict]:
    """mia.json's attacks that carry pooled intervals (offline LiRA and RMIA, online LiRA, the
    server's on every upload)."""
    return {name: v["pooled"] for name, v in report["summary"].items() if isinstance(v, dict) and "pooled" in v}


def maxrenyi_pooled(report: dict) -> dict[str, dict]:
    """A MaxRényi report's attacks with bootstrap intervals, by name: MaxRényi-10% (alpha 0.5,
    fixed in advance) on the server's model and on the rebuilt client models, the base-model
    calibrated likelihood and RMIA on the client models, and the server's attacks on every upload
    where the run kept them."""
    threats = report["threats"]
    server = threats.get("server", {}).get(HEADLINE, {})
    clients = threats.get("client", {}).get("pooled", {})
    uploads = threats.get("uploads", {}).get("summary", {})
    found = {
        "server-maxrenyi10": server.get("intervals", {}),
        "clients-maxrenyi10": clients.get(HEADLINE, {}),
        "clients-calibrated-base": clients.get("calibrated-base", {}),
        "clients-rmia-base": clients.get("rmia-base", {}),
        **{f"uploads-{k.removeprefix('server-')}": v["pooled"] for k, v in uploads.items()},
    }
    return {name: v for name, v in found.items() if v}


def global_pooled(report: dict) -> dict[str, dict]:
    """global_attack.json's attacks on the run's final global model, pooled over clients."""
    return {name: a["pooled"] for name, a in report["attacks"].items()}


def _read(run_dir: Path, name: str, pooled) -> dict[str, dict] | None:
    path = Path(run_dir) / name
    return pooled(json.loads(path.read_text())) if path.exists() else None


def read_prompt(run_dir: Path) -> dict[str, dict] | None:
    """The pooled attacks of a run folder's mia.json (``Family.attack_report``), or None."""
    return _read(run_dir, MIA, prompt_pooled)


def read_maxrenyi(run_dir: Path) -> dict[str, dict] | None:
    """The pooled attacks of a run folder's maxrenyi.json (``Family.attack_report``), or None."""
    return _read(run_dir, MAXRENYI, maxrenyi_pooled)


def read_global(run_dir: Path) -> dict[str, dict] | None:
    """The pooled attacks of a run folder's global_attack.json (``Family.attack_report``), or None."""
    return _read(run_dir, GLOBAL, global_pooled)
