"""Run the membership-inference attacks against a finished run folder.

    python -m fedvlm.attacks <run-dir> [--shadows 2] [--online 4] [--per-class] [--shadow-data-root DIR]

Reads the run's results.json (its validated config) and the prompts its clients published,
trains shadow federations like the target on disjoint shadow data (the embedded task's
independent draw, or an image folder you supply), and writes ``mia.json`` into the run
folder: Shokri and loss-threshold attack accuracy, AUC and TPR at 1% FPR; offline LiRA and RMIA
(the shadow federations' clients of the same partition as reference models) with AUC and TPR at
0.1% and 1% FPR, each with a bootstrap 95% interval, per client and pooled. With ``--online R``
it also trains R reference federations on the target's own data, each client on a seeded half of
its membership candidates (``data/membership.py``), and runs online LiRA: every tested record is
"in" for R/2 of them and "out" for the other R/2. Where the run kept what its server saw
(``attack.observe-uploads``), the honest-but-curious server's attacks on every upload of every round
(``attacks.server``) join them, calibrated by the shadow and reference federations' own uploads.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedvlm.attacks.membership import (
    OFFLINE_ATTACKS,
    ONLINE_ATTACKS,
    References,
    ShadowAttack,
    client_records,
    evaluate_reference_attacks,
    interval_summary,
    load_published,
)
from fedvlm.attacks.reports import ATTACKED, MIA, prompt_pooled
from fedvlm.attacks.server import ATTACKS as SERVER_ATTACKS
from fedvlm.attacks.server import ServerAttack, server_scores
from fedvlm.client_app.node import node_data
from fedvlm.client_app.node_config import NUM_PARTITIONS, PARTITION_ID
from fedvlm.data.membership import reference_inclusion
from fedvlm.methods.registry import get_method
from fedvlm.methods.validation import validate
from fedvlm.runconfig import RunConfig, datasets
from fedvlm.server_app.observer import FOLDER as UPLOADS
from fedvlm.utils.files import UnreadableFile, atomic_write_json, read_results

log = logging.getLogger(__name__)


def _publish_only(cfg: dict) -> dict:
    """What a federation trained for the attack evaluates: its last round only. The attack reads
    the prompts the last evaluation publishes, never the rounds' figures, and evaluating every
    round was most of its time (FedOTP's transport-weighted scores: 29 of a shadow federation's
    40 s in a two-round profile; docs/results/membership-inference.md). Training, and so the
    published prompts, are the same either way (evaluation only evaluates). It is a new run in
    its own folder: a target that was resumed does not make it continue the target's folder."""
    return {**cfg, "evaluate-every": int(cfg["num-server-rounds"]), "resume": ""}


def shadow_config(target_cfg: dict, shadow_index: int, out_dir: Path, shadow_data_root: str | None) -> dict:
    cfg = _publish_only(target_cfg)
    if shadow_data_root:
        cfg.update({"dataset": "image-folder", "data-root": str(Path(shadow_data_root).resolve())})
    elif datasets.BY_NAME[cfg["dataset"]].shadow:
        cfg.update({"dataset": datasets.BY_NAME[cfg["dataset"]].shadow})
    else:
        raise ValueError(
            f"shadow models need data disjoint from the target's; dataset {cfg['dataset']!r} has no built-in "
            "shadow split: pass --shadow-data-root with an image folder from the same distribution"
        )
    cfg.update(
        {
            "seed": int(cfg["seed"]) + 1000 + shadow_index,
            "output-dir": str(out_dir),
            "run-name": f"shadow-{shadow_index}",
            "privacy.max-epsilon": 0.0,
        }
    )
    return cfg


def reference_config(target_cfg: dict, reference: int, out_dir: Path, candidate_seed: int) -> dict:
    """Online reference federation ``reference``: the target's config and partitions (same seed),
    each node training on a half of its membership candidates; its DP noise and batch sampling
    from OS entropy, so that it shares no randomness with a seeded target."""
    cfg = _publish_only(target_cfg)
    cfg.update(
        {
            "attack.reference": reference,
            "attack.candidate-seed": candidate_seed,
            "privacy.noise-source": "os",
            "output-dir": str(out_dir),
            "run-name": f"reference-{reference}",
            "privacy.max-epsilon": 0.0,
        }
    )
    return cfg


def _train(raw: dict, n: int, run_id: str) -> tuple[dict[int, dict], Path]:
    """Train one federation in-process: its clients' published prompts by partition id, and its
    run folder."""
    from fedvlm.client_app.app import app as client_app
    from fedvlm.server_app.app import execute
    from fedvlm.utils.inprocess import InProcessGrid

    cfg = validate(raw)
    grid = InProcessGrid(client_app, [{PARTITION_ID: i, NUM_PARTITIONS: n} for i in range(n)], cfg.as_dict())
    with contextlib.redirect_stdout(io.StringIO()):
        rec = execute(cfg, grid, run_id=run_id)
    return {p["partition_id"]: p for p in load_published(rec.dir / "published").values()}, rec.dir


@dataclass
class ServerView:
    """The server's scores (``attacks.server``), partition id -> {score: [2k]}, under the target's
    uploads, each shadow federation's and each online reference's, with which candidates each
    reference trained on."""

    target: dict[int, dict[str, np.ndarray]]
    offline: list[dict[int, dict[str, np.ndarray]]]
    online: list[dict[int, dict[str, np.ndarray]]]
    inside: dict[int, list[np.ndarray]]

    def evaluate(self, server: ServerAttack, clients: dict[int, str], seed: int) -> dict:
        scores, member = {}, {}
        for pid, target in self.target.items():
            name = clients.get(pid, f"partition-{pid}")
            scores[name] = server_scores(
                target,
                [o[pid] for o in self.offline if pid in o],
                [o[pid] for o in self.online if pid in o],
                self.inside.get(pid, []),
            )
            member[name] = server.member(pid)
        return interval_summary(scores, member, seed)


@dataclass
class _Attacker:
    """What the attacks on one run gather as they train their federations: each shadow
    federation's client records, each target client's records under the reference models, and the
    server's view where the run kept its uploads (``server``)."""

    cfg: RunConfig
    sim: dict[str, dict]  # the target's simulated clients' published prompts, by name
    n: int  # the target's clients
    seed: int
    tmp: Path
    server: ServerAttack | None
    seen: ServerView
    references: dict[str, References] = field(default_factory=dict)
    shadow_records: list = field(default_factory=list)

    def shadow(self, s: int, data_root: str | None) -> None:
        """Shadow federation ``s``: its clients' records, and the offline references (the same
        partition, on disjoint shadow data: it never saw the target's records)."""
        scfg = validate(shadow_config(self.cfg.as_dict(), s, self.tmp, data_root))
        pubs, folder = _train(scfg.as_dict(), self.n, f"shadow-{s}")
        if self.server is not None:
            self.seen.offline.append(self.server.scores(folder))
        self.shadow_records += [client_records(scfg, pub, self.n, self.seed + 1 + s) for pub in pubs.values()]
        for pub in self.sim.values():
            if pub["partition_id"] in pubs:
                under = pubs[pub["partition_id"]]
                self.references[pub["node"]].offline.append(
                    client_records(self.cfg, pub, self.n, self.seed, under=under)
                )

    def online(self, j: int) -> None:
        """Online reference federation ``j``, trained on a half of each target client's candidates."""
        pubs, folder = _train(reference_config(self.cfg.as_dict(), j, self.tmp, self.seed), self.n, f"reference-{j}")
        if self.server is not None:
            self.seen.online.append(self.server.scores(folder))
        for pub in self.sim.values():
            pid = pub["partition_id"]
            if pid in pubs:
                part = node_data(self.cfg, {PARTITION_ID: pid, NUM_PARTITIONS: self.n}).part
                refs = self.references[pub["node"]]
                refs.online.append(client_records(self.cfg, pub, self.n, self.seed, under=pubs[pid]))
                refs.inside.append(reference_inclusion(part, self.seed, pid, j))
                self.seen.inside.setdefault(pid, []).append(refs.inside[-1])

    def evaluate(self, targets: list, per_class: bool) -> dict:
        """Every attack's figures: the shadow-model attack's, the reference attacks', the server's."""
        result = ShadowAttack(self.shadow_records, per_class, len(targets[0].probs[0]), self.seed).evaluate(targets)
        found = [evaluate_reference_attacks(targets, self.references, self.seed)]
        if self.server is not None:
            by_partition = {pub["partition_id"]: pub["node"] for pub in self.sim.values()}
            found.append(self.seen.evaluate(self.server, by_partition, self.seed))
        for more in found:
            result["summary"].update(more["summary"])
            for client, figures in more["per_client"].items():
                result["per_client"].setdefault(client, {}).update(figures)
        return result


def run_attacks(
    run_dir: Path,
    shadows: int = 2,
    per_class: bool = False,
    shadow_data_root: str | None = None,
    seed: int = 0,
    online: int = 0,
) -> dict:
    """Shokri, loss threshold, offline LiRA and RMIA from ``shadows`` shadow federations; with
    ``online`` (even) reference federations on the target's own candidates, online LiRA too."""
    if online % 2:
        raise ValueError(f"--online must be even (reference federations come in complementary pairs), got {online}")
    run_dir = Path(run_dir)
    data = read_results(run_dir, ATTACKED)
    cfg = validate(data["config"])
    published = load_published(run_dir / "published")
    sim = {k: v for k, v in published.items() if v["partition_id"] >= 0}
    if not sim:
        raise FileNotFoundError(f"no published prompts of simulated clients under {run_dir / 'published'}")
    n = len([nd for nd in data["run"]["nodes"] if nd["partition_id"] >= 0])
    t0 = time.time()
    targets = [client_records(cfg, pub, n, seed) for pub in sim.values()]
    # the server's attack, where the run kept what the server saw (attack.observe-uploads); the
    # shadow and reference federations inherit the key, so they keep theirs too
    server = ServerAttack(cfg, n, seed) if (run_dir / UPLOADS).is_dir() else None
    seen = ServerView(server.scores(run_dir) if server else {}, [], [], {})
    with tempfile.TemporaryDirectory() as tmp:
        attacker = _Attacker(cfg, sim, n, seed, Path(tmp), server, seen)
        attacker.references = {pub["node"]: References([], [], []) for pub in sim.values()}
        for s in range(shadows):
            log.info("training shadow federation %d/%d", s + 1, shadows)
            attacker.shadow(s, shadow_data_root)
        for j in range(online):
            log.info("training online reference federation %d/%d", j + 1, online)
            attacker.online(j)
    result = attacker.evaluate(targets, per_class)
    result.update(
        {
            "target_run": str(run_dir),
            "method": cfg.method,
            "privacy": data.get("privacy", {}).get("settings"),
            "epsilon_spent": (data.get("privacy", {}).get("rounds") or [{}])[-1],
            "shadows": {
                "federations": shadows,
                "clients": len(attacker.shadow_records),
                "dataset": "image-folder" if shadow_data_root else f"{cfg.dataset}-shadow",
            },
            "online_references": online,
            "server_attack": "every upload of every round (attack.observe-uploads)"
            if server
            else "not run: the run kept no uploads (run it with attack.observe-uploads=true)",
            "attack_model": "per-class MLPs (Shokri)" if per_class else "pooled MLP on class-aligned log-probabilities",
            "records_per_target_client": int(len(targets[0].member)),
            "seconds": round(time.time() - t0, 1),
        }
    )
    atomic_write_json(result, run_dir / MIA)
    return result


def pooled_attacks(run_dir: Path, shadows: int = 2, online: int = 0) -> dict[str, dict]:
    """The prompt family's membership attacks on a finished run (``Family.membership_attack``):
    mia.json's attacks that carry pooled intervals (offline LiRA and RMIA, online LiRA with
    ``online`` reference federations, the server's where the run kept its uploads), running them
    first where the folder has none, or has one made with other ``shadows`` or ``online``."""
    path = Path(run_dir) / MIA
    result = json.loads(path.read_text()) if path.exists() else None
    if result is None or (result["shadows"]["federations"], result.get("online_references", 0)) != (shadows, online):
        result = run_attacks(run_dir, shadows=shadows, online=online)  # none yet, or made with other knobs
    return prompt_pooled(result)


def _interval(metric: dict, digits: int) -> str:
    low, high = metric["ci95"]
    return f"{metric['value']:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedvlm.attacks", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--shadows", type=int, default=2, help="shadow federations to train (default 2)")
    p.add_argument("--per-class", action="store_true", help="one attack model per class (Shokri) instead of pooled")
    p.add_argument("--shadow-data-root", help="image folder of shadow data (needed for non-embedded datasets)")
    p.add_argument(
        "--online",
        type=int,
        default=0,
        help="online LiRA: train this many (even) reference federations on the target's own candidates, "
        "each record in half of them (default 0: offline attacks only)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=300, help="VLM runs: members and non-members per attacked model")
    args = p.parse_args(argv)
    if args.shadows < 1 or args.online < 0 or args.online % 2 or args.samples < 1:
        p.error("--shadows and --samples must be at least 1, --online an even number of 0 or more")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        recorded = read_results(args.run_dir, ATTACKED)["run"].get("method")
        method = get_method(recorded)
    except UnreadableFile as err:
        p.error(str(err))
    except ValueError as err:  # no method, or one this fedvlm does not know
        p.error(f"{args.run_dir / 'results.json'}: run.method = {recorded!r}: {err}; {ATTACKED}")
    if method.adapter:  # FedRand and its LoRA baselines: the MaxRényi-K% attack (attacks.maxrenyi)
        from fedvlm.attacks.maxrenyi import main as maxrenyi_main

        return maxrenyi_main([str(args.run_dir), "--samples", str(args.samples), "--seed", str(args.seed)])
    res = run_attacks(args.run_dir, args.shadows, args.per_class, args.shadow_data_root, args.seed, args.online)
    s = res["summary"]
    print(
        f"membership inference on {res['method']} ({res['records_per_target_client']} records per client, "
        f"chance = 50%):"
    )
    for name in ("shokri", "loss-threshold"):
        print(
            f"  {name:20s} accuracy {100 * s[name]['accuracy']:.1f}%  AUC {s[name]['auc']:.3f}  "
            f"TPR@1%FPR {100 * s[name]['tpr@1%fpr']:.1f}% (chance {100 * s[name]['tpr@1%fpr-chance']:.1f}%: "
            "each client's non-members)"
        )
    for name in [a for a in OFFLINE_ATTACKS + ONLINE_ATTACKS + SERVER_ATTACKS if a in s]:
        pooled = s[name]["pooled"]
        print(
            f"  {name:20s} pooled AUC {_interval(pooled['auc'], 3)}  TPR@1%FPR {_interval(pooled['tpr@1%fpr'], 3)}  "
            f"TPR@0.1%FPR {_interval(pooled['tpr@0.1%fpr'], 3)}"
        )
    print(f"written: {args.run_dir / 'mia.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
