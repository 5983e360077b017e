"""MaxRényi-K%: a reference-free membership attack on VLMs (Li et al., 2024; FedRand's MIA).

For every token of a sample's target text (the caption or the answer), the model's
next-token distribution p has a Rényi entropy

    H_a(p) = log(sum_i p_i^a) / (1 - a)   (a = 1: Shannon; a = inf: -log max_i p_i).

MaxRényi-K% is the mean of the K% largest per-token entropies (K = 0: the largest one). A
model is more certain on what it was trained on, so a lower score means "member"; AUROC and
TPR at 5% FPR are computed with -score as the member score.

Threats (docs/methods.md, "FedRand"), both from what the server of a run holds:
- ``server``: the final shared adapter (``final_shared.pt``), the client-only parts at their
  seeded initial values;
- ``client``: each client's model as the server can rebuild it from the client's last
  uploads (``reconstructed/<client>.pt``): FedAvg-LoRA exactly, FedRand from its last A and
  last B uploads (a half it never uploaded taken from the final server adapter), FedPer and
  FedPara the server-side parts only.

Members are the attacked client's training samples (the union of all clients' for the server
model), non-members held-out test samples of the same distribution, balanced. Every result
also carries AUC and TPR at 1% and 0.1% FPR with bootstrap 95% intervals; the client threat is
also pooled (all clients' samples in one ROC). ``HEADLINE`` is the setting fixed in advance for
comparisons with intervals (FedRand's MaxRényi-10%), so that no best-of-eight selection inflates them.

With ``attack.observe-uploads`` the run also kept every upload of every round, and the server's
attacks on them (``attacks.server``: alignment and decomposition of each upload against the
candidates' gradients under the model the server can rebuild at that round) are a third threat,
``uploads``.

Against the rebuilt client models two attacks also use a reference model the server has for
free and that never saw any data, the pretrained base model (every adapter at its initial
value): the likelihood calibrated by it (offline LiRA with one reference) and offline RMIA
(``reference_attacks``). Calibrating by a reference removes how hard each sample is for any
model, which a reference-free score cannot.

    python -m fedvlm.attacks.maxrenyi <run-dir> [--samples 300]      -> <run-dir>/maxrenyi.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score, roc_curve

from fedvlm.attacks import NoAttackApplies
from fedvlm.attacks.likelihood import bootstrap, rmia
from fedvlm.attacks.reports import ATTACKED, HEADLINE, MAXRENYI, maxrenyi_pooled
from fedvlm.client_app.node_config import NUM_PARTITIONS, PARTITION_ID
from fedvlm.runconfig import RunConfig
from fedvlm.server_app.observer import FOLDER as UPLOADS
from fedvlm.spec import spec_of
from fedvlm.utils.files import UnreadableFile, atomic_write_json, load_saved, read_results

log = logging.getLogger(__name__)

ALPHAS = (0.5, 1.0, 2.0, math.inf)
KS = (0, 10)
LOGLIK = "loglik"  # sample_scores' key of the mean target-token log-likelihood


def renyi_entropy(logits: torch.Tensor, alpha: float) -> torch.Tensor:
    """Rényi entropy of softmax(logits) along the last dimension."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    if alpha == 1.0:
        return -(logp.exp() * logp).sum(-1)
    if math.isinf(alpha):
        return -logp.max(dim=-1).values
    return torch.logsumexp(alpha * logp, dim=-1) / (1.0 - alpha)


def max_k_percent(values: torch.Tensor, k: float) -> float:
    """Mean of the largest k% of ``values`` (k = 0: the maximum; at least one value)."""
    n = values.numel()
    take = max(1, int(math.ceil(n * k / 100.0))) if k > 0 else 1
    return float(values.topk(min(take, n)).values.mean())


@torch.no_grad()
def sample_scores(vlm, split, idx: np.ndarray, batch_size: int = 16) -> dict[str, np.ndarray]:
    """MaxRényi-K% of every sample in ``idx`` for each (alpha, K): {'alpha=0.5,K=0': [n], ...},
    and ``LOGLIK``: each sample's mean log-probability of its target tokens."""
    out: dict[str, list[float]] = {f"alpha={a:g},K={k}": [] for a in ALPHAS for k in KS}
    out[LOGLIK] = []
    for s in range(0, len(idx), batch_size):
        chunk = [int(i) for i in idx[s : s + batch_size]]
        batch = vlm.training_batch(
            [split.images.image(i) for i in chunk], [split.prompts[i] for i in chunk], [split.targets[i] for i in chunk]
        )
        logits, targets = vlm.token_logits(batch)
        mask = targets != -100
        token_loss = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none")
        out[LOGLIK].extend((-token_loss.sum(1) / mask.sum(1).clamp(min=1)).tolist())
        for a in ALPHAS:
            ent = renyi_entropy(logits, a)
            for row in range(len(chunk)):
                vals = ent[row][mask[row]]
                for k in KS:
                    out[f"alpha={a:g},K={k}"].append(max_k_percent(vals, k))
    return {key: np.asarray(v) for key, v in out.items()}


def auroc_and_tpr(member_scores: np.ndarray, nonmember_scores: np.ndarray, fpr_at: float = 0.05) -> dict:
    """Lower MaxRényi = member: the attack's member score is its negation. AUROC and TPR at 5%
    FPR (FedRand's report), and ``intervals``: AUC and TPR at 1% and 0.1% FPR with bootstrap 95%
    intervals (``likelihood.bootstrap``, fixed seed)."""
    y = np.r_[np.ones(len(member_scores)), np.zeros(len(nonmember_scores))]
    s = -np.r_[member_scores, nonmember_scores]
    fpr, tpr, _ = roc_curve(y, s)
    return {
        "auroc": float(roc_auc_score(y, s)),
        f"tpr@{fpr_at:.0%}fpr": float(np.interp(fpr_at, fpr, tpr)),
        "n_members": int(len(member_scores)),
        "n_nonmembers": int(len(nonmember_scores)),
        "intervals": bootstrap(s, y.astype(bool)),
    }


Scores = dict[str, tuple[np.ndarray, np.ndarray]]  # setting -> (members' scores, non-members')


def reference_attacks(target: np.ndarray, reference: np.ndarray, member: np.ndarray) -> dict[str, np.ndarray]:
    """Attacks from one reference model that never saw the data (the pretrained base model, the
    adapter at its initial values), on each sample's mean target-token log-likelihood, higher =
    member: ``calibrated-base`` = target minus reference log-likelihood (LiRA's offline test with
    a single reference: the per-sample mean is the reference's value, one variance for all, so the
    ranking is that of the difference); ``rmia-base`` = offline RMIA with Pr(x|model) the
    geometric mean of its target tokens' probabilities, the population the non-members."""
    pop = ~member
    p_x, p_ref = np.exp(target), np.exp(reference)[None, :]
    return {
        "calibrated-base": target - reference,
        "rmia-base": rmia(p_x, p_ref, p_x[pop], p_ref[:, pop], x_in_z=np.where(pop, np.cumsum(pop) - 1, -1)),
    }


def attack(
    vlm, adapter: dict[str, torch.Tensor], members, nonmembers, samples: int, seed: int, base: dict | None = None
) -> tuple[dict, Scores]:
    """Every (alpha, K) attack on one model (``members``/``nonmembers`` are VLMSplits), and with
    ``base`` (the adapter at its initial values) the reference attacks: the metrics, and the
    scores themselves (member score, higher = member) for pooling over clients."""
    from fedvlm.models.vlm import load_adapter_state

    rng = np.random.default_rng(seed)
    n = min(samples, len(members), len(nonmembers))
    mi = rng.choice(len(members), n, replace=False)
    ni = rng.choice(len(nonmembers), n, replace=False)
    load_adapter_state(vlm.model, adapter)
    ms, ns = sample_scores(vlm, members, mi), sample_scores(vlm, nonmembers, ni)
    loglik = np.r_[ms.pop(LOGLIK), ns.pop(LOGLIK)]
    metrics = {key: auroc_and_tpr(ms[key], ns[key]) for key in ms}
    scores: Scores = {key: (-ms[key], -ns[key]) for key in ms}  # lower MaxRényi = member
    if base is not None:
        load_adapter_state(vlm.model, base)
        ref = np.r_[sample_scores(vlm, members, mi)[LOGLIK], sample_scores(vlm, nonmembers, ni)[LOGLIK]]
        member = np.r_[np.ones(n, bool), np.zeros(n, bool)]
        for key, v in reference_attacks(loglik, ref, member).items():
            metrics[key] = {"intervals": bootstrap(v, member)}
            scores[key] = (v[member], v[~member])
    return metrics, scores


_FEDPARA_BASE = (
    "FedPara's server holds only the w1 pair of the LoHa adapter; with the clients' private w2 pair "
    "at its initial zero, the server model and every client model it rebuilds are the base model: "
    "there is nothing of the clients' data to attack"
)


def _client_threat(
    vlm, run_dir: Path, parts: dict, initial: dict, shared: dict, test, samples: int, clients: int, seed: int
):
    """(b) each client's model as the server can rebuild it from the client's uploads: the
    attacks by client, and every attack's (member, non-member) scores by client for pooling."""
    recon_dir = run_dir / "reconstructed"
    per_client: dict[str, dict] = {}
    pooled: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for i, (name, part) in enumerate(sorted(parts.items())):
        if clients and i >= clients:
            break
        path = recon_dir / f"{name}.pt"
        if not path.exists():
            continue
        uploads = load_saved(path, "run the attack on a finished run")["arrays"]
        adapter = {**initial, **shared, **uploads}
        per_client[name], scores = attack(
            vlm, adapter, part.train, part.test if len(part.test) >= 10 else test, samples, seed + 1 + i, initial
        )
        for key, (ms, ns) in scores.items():
            pooled.setdefault(key, []).append((ms, ns))
        per_client[name]["uploaded"] = sorted({k.split(".")[-2] for k in uploads})
        log.info("client %s: %s", name, _headline(per_client[name]))
    return per_client, pooled


def _client_section(per_client: dict[str, dict], pooled: dict[str, list[tuple[np.ndarray, np.ndarray]]]) -> dict:
    """The rebuilt client models' threat: the mean over clients of each score's figures, every
    client's members and non-members together in one ROC (bootstrap 95% intervals), each client's."""
    keys = [k for k in next(iter(per_client.values())) if k.startswith("alpha=")]
    return {
        "mean": {
            k: {
                "auroc": float(np.mean([c[k]["auroc"] for c in per_client.values()])),
                "tpr@5%fpr": float(np.mean([c[k]["tpr@5%fpr"] for c in per_client.values()])),
            }
            for k in keys
        },
        "pooled": {key: _pooled(v) for key, v in pooled.items()},
        "per_client": per_client,
    }


def run_maxrenyi(run_dir: Path, samples: int = 300, clients: int = 0, seed: int = 0) -> dict:
    from fedvlm.client_app.vlm_node import vlm_node_data
    from fedvlm.methods.validation import validate
    from fedvlm.models.vlm import load_vlm

    run_dir = Path(run_dir)
    data = read_results(run_dir, ATTACKED)
    cfg = validate(data["config"])
    spec = spec_of(cfg)
    if not spec.adapter:
        raise ValueError(
            f"MaxRényi attacks the VLM methods; run {run_dir} used {spec.name!r} (use `python -m fedvlm.attacks`)"
        )
    vlm, initial, _ = load_vlm(cfg, spec.adapter)
    shared = dict(load_saved(run_dir / "final_shared.pt", "run the attack on a finished run")["arrays"])
    nodes = [n for n in data["run"]["nodes"] if n["partition_id"] >= 0]
    num = len(nodes)
    parts = {n["name"]: vlm_node_data(cfg, {PARTITION_ID: n["partition_id"], NUM_PARTITIONS: num}) for n in nodes}
    report: dict = {
        "run": str(run_dir),
        "method": spec.name,
        "samples": samples,
        "alphas": [str(a) for a in ALPHAS],
        "ks": list(KS),
        "threats": {},
    }

    # FedPara's uploads are the w1 pair only: with the clients' private w2 pair at its initial zero,
    # the server model and every client model the server rebuilds are the base model, so an attack
    # on them would score the base model and find nothing by design
    rebuildable = spec.adapter != "loha"
    per_client: dict[str, dict] = {}
    pooled: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    if not rebuildable:
        report["threats"]["server"] = {"skipped": _FEDPARA_BASE}
        report["threats"]["client"] = {"skipped": _FEDPARA_BASE}
    else:
        # (a) the server model: members = every client's training data
        union = _concat([p.train for p in parts.values()])
        test = next(iter(parts.values())).dataset.test
        report["threats"]["server"] = attack(vlm, {**initial, **shared}, union, test, samples, seed)[0]
        log.info("server model: %s", _headline(report["threats"]["server"]))
        per_client, pooled = _client_threat(vlm, run_dir, parts, initial, shared, test, samples, clients, seed)
    if per_client:
        report["threats"]["client"] = _client_section(per_client, pooled)
    if (run_dir / UPLOADS).is_dir():  # every upload of every round, where the run kept them
        uploads = report["threats"]["uploads"] = upload_attacks(cfg, run_dir, nodes, samples, seed)
        log.info("uploads, pooled AUC: %s", {k: v["pooled"]["auc"]["value"] for k, v in uploads["summary"].items()})
    atomic_write_json(report, run_dir / MAXRENYI)
    return report


SAMPLES = 100  # members and non-members per attacked model where a caller names no other


def pooled_attacks(run_dir: Path, shadows: int = 0, online: int = 0) -> dict[str, dict]:
    """The VLM family's membership attacks on a finished run (``Family.membership_attack``): the
    pooled ones of its maxrenyi.json, running the attack first where the folder has none. They
    need no shadow or reference federations (``shadows`` and ``online`` are the prompt family's
    knobs): the base model calibrates them."""
    path = Path(run_dir) / MAXRENYI
    report = json.loads(path.read_text()) if path.exists() else run_maxrenyi(Path(run_dir), SAMPLES)
    found = maxrenyi_pooled(report)
    if not found:
        skipped = [t["skipped"] for t in report["threats"].values() if "skipped" in t]
        raise NoAttackApplies("; ".join(dict.fromkeys(skipped)) or "no threat of the MaxRényi report applies")
    return found


def upload_attacks(cfg: RunConfig, run_dir: Path, nodes: list[dict], samples: int, seed: int) -> dict:
    """The honest-but-curious server's attacks on every LoRA upload it saw (``attacks.server``):
    alignment and decomposition, per client and pooled, with intervals."""
    from fedvlm.attacks.membership import interval_summary
    from fedvlm.attacks.server import ServerAttack, server_scores

    server = ServerAttack(cfg, len(nodes), seed, samples)
    names = {n["partition_id"]: n["name"] for n in nodes}
    by_partition = server.scores(run_dir)
    scores = {names[pid]: server_scores(s, [], [], []) for pid, s in by_partition.items()}
    return interval_summary(scores, {names[pid]: server.member(pid) for pid in by_partition}, seed)


def _pooled(scores: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """Every client's members and non-members in one ROC (member scores, higher = member)."""
    members, nonmembers = np.concatenate([m for m, _ in scores]), np.concatenate([n for _, n in scores])
    return bootstrap(np.r_[members, nonmembers], np.r_[np.ones(len(members), bool), np.zeros(len(nonmembers), bool)])


def _concat(splits):
    from fedvlm.data.sources import ArraySource
    from fedvlm.data.vlm_data import VLMSplit

    idx_sources = [(s, i) for s in splits for i in range(len(s))]
    images = np.stack([np.asarray(s.images.image(i)) for s, i in idx_sources])
    labels = np.concatenate([s.labels for s in splits])
    return VLMSplit(
        ArraySource(images, labels, "union"),
        [s.prompts[i] for s, i in idx_sources],
        [s.targets[i] for s, i in idx_sources],
        [s.references[i] for s, i in idx_sources],
    )


def _headline(res: dict) -> str:
    k = HEADLINE
    return (
        f"MaxRényi-10% (alpha 0.5) AUROC {res[k]['auroc']:.3f}, TPR@5%FPR {res[k]['tpr@5%fpr']:.3f}" if k in res else ""
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedvlm.attacks.maxrenyi", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--samples", type=int, default=300, help="members and non-members per attacked model")
    p.add_argument("--clients", type=int, default=0, help="attack at most this many clients' models (0 = all)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        report = run_maxrenyi(args.run_dir, args.samples, args.clients, args.seed)
    except UnreadableFile as err:  # the run's own file: named, with what to do
        p.error(str(err))
    print(
        json.dumps(
            {t: (v.get("mean", v) if isinstance(v, dict) else v) for t, v in report["threats"].items()}, indent=1
        )[:4000]
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
