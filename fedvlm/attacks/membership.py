"""Membership inference against published prompts (DP-FPL's threat model, its appendix A.3).

The adversary is a user who received a client's published personalised prompt and has the
public CLIP backbone. Given an image with its label it must tell whether the image was in
that client's training data.

Target data: for every client that published a prompt, members are images of its training
set and non-members are images of its test set (the same classes, never trained on). The
two sets are explicit and disjoint, and balanced by subsampling the larger one with a fixed
seed. (DP-FPL's public code draws its "members" from images the model never trained on;
this does not.)

Attacks:
- Shokri et al. (2017): shadow federations are trained exactly like the target (same
  method, config, number of clients and rounds) on disjoint shadow data; every shadow
  client's published prompt labels its own members/non-members; an attack model, a
  2-layer MLP on the prediction vector, learns to separate them, either one model per class
  (``per_class``, Shokri's original) or one pooled model on the class-aligned vector (the
  true class's probability first, then the others sorted).
- Loss threshold (Yeom et al., 2018): score = -cross-entropy; the threshold is chosen on the
  shadow clients. A cheap second opinion that needs no attack model.

Reported per attack: accuracy, ROC AUC and TPR at 1% FPR, averaged over target clients and
computed on all target records pooled.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedvlm.attacks.likelihood import (
    bootstrap,
    chance,
    lira_offline,
    lira_online,
    logit_confidence,
    rmia,
    roc_metrics,
)
from fedvlm.client_app.node import node_data
from fedvlm.client_app.node_config import NUM_PARTITIONS, PARTITION_ID
from fedvlm.client_app.prompt_clients import PromptClient
from fedvlm.data.membership import membership_candidates
from fedvlm.methods.registry import get_method
from fedvlm.models.clip_loader import load_clip
from fedvlm.runconfig import RunConfig

log = logging.getLogger(__name__)
TPR1 = "tpr@1%fpr"  # a key of likelihood.roc_metrics


@dataclass
class Records:
    """Prediction vectors of labelled images under one published prompt, with membership."""

    probs: np.ndarray  # [n, C] softmax over all classes
    labels: np.ndarray  # [n]
    member: np.ndarray  # [n] bool
    client: str

    @property
    def losses(self) -> np.ndarray:
        return -np.log(np.clip(self.probs[np.arange(len(self.labels)), self.labels], 1e-12, None))


def load_published(folder: Path) -> dict[str, dict]:
    return {p.stem: torch.load(p, map_location="cpu", weights_only=False) for p in sorted(Path(folder).glob("*.pt"))}


@torch.no_grad()
def client_records(
    cfg: RunConfig, published: dict, num_partitions: int, seed: int, under: dict | None = None
) -> Records:
    """The balanced member/non-member records of one published client prompt, scored under
    that prompt or, with ``under``, under another published prompt (a reference model's)."""
    node = node_data(cfg, {PARTITION_ID: published["partition_id"], NUM_PARTITIONS: num_partitions})
    bundle = load_clip(cfg.clip.model, cfg.clip.pretrained, cfg.cache_path, cfg.device)
    if bundle.fingerprint != published["backbone"]:
        raise ValueError(
            f"{published['node']} was published for backbone {published['backbone']}, "
            f"this config loads {bundle.fingerprint}"
        )
    members, non_members = membership_candidates(node.part, seed, published["partition_id"])
    k = len(members)
    client = get_method(published["method"]).client
    assert issubclass(client, PromptClient)  # a published prompt comes from a prompt method's node
    scorer = client.scorer_class(bundle, node.splits.classnames, cfg)
    probs, labels = [], []
    for split, idx in ((node.splits.train, members), (node.splits.test, non_members)):
        feats = scorer.image_features(split, idx, cfg.cache_path).to(bundle.device)
        prompts = (under or published)["prompts"]
        probs.append(F.softmax(scorer.logits(prompts, feats), dim=-1).cpu().numpy())
        labels.append(split.labels[idx])
    return Records(
        np.concatenate(probs), np.concatenate(labels), np.r_[np.ones(k, bool), np.zeros(k, bool)], published["node"]
    )


def _aligned(probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Class-agnostic features: the true class's probability, then the rest sorted."""
    true = probs[np.arange(len(labels)), labels]
    rest = probs.copy()
    rest[np.arange(len(labels)), labels] = -1.0
    rest = -np.sort(-rest, axis=1)[:, :-1]
    return np.log(np.clip(np.c_[true, rest], 1e-12, None))


class AttackMLP(torch.nn.Module):
    mu: torch.Tensor  # buffers registered by the training function
    sd: torch.Tensor

    def __init__(self, d_in: int, hidden: int = 64):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(d_in, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, 1),
        )

    def forward(self, x):
        return self.net(x).squeeze(-1)


def _fit_mlp(x: np.ndarray, y: np.ndarray, seed: int, epochs: int = 300) -> AttackMLP:
    torch.manual_seed(seed)
    xt, yt = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
    mu, sd = xt.mean(0), xt.std(0) + 1e-6
    model = AttackMLP(x.shape[1])
    model.register_buffer("mu", mu)
    model.register_buffer("sd", sd)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3, weight_decay=1e-4)
    for _ in range(epochs):
        loss = F.binary_cross_entropy_with_logits(model((xt - mu) / sd), yt)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


@torch.no_grad()
def _score_mlp(model: AttackMLP, x: np.ndarray) -> np.ndarray:
    xt = torch.tensor(x, dtype=torch.float32)
    return torch.sigmoid(model((xt - model.mu) / model.sd)).numpy()


def attack_metrics(scores: np.ndarray, member: np.ndarray, threshold: float) -> dict:
    """Accuracy at ``threshold``, ROC AUC and TPR at FPR <= 1% (higher score = member), the last
    with its chance level: a client's 16 non-members allow no false positive at 1%, so its chance
    is 1/17, not 1% (``likelihood.chance``)."""
    if len(np.unique(member)) < 2:
        nan = float("nan")
        return {"accuracy": nan, "auc": nan, TPR1: nan, TPR1 + "-chance": nan, "n": int(len(member))}
    roc = roc_metrics(scores, member)
    return {
        "accuracy": float(np.mean((scores >= threshold) == member)),
        "auc": roc["auc"],
        TPR1: roc[TPR1],
        TPR1 + "-chance": chance(TPR1, int((~np.asarray(member, bool)).sum())),
        "n": int(len(member)),
    }


def _best_threshold(scores: np.ndarray, member: np.ndarray) -> float:
    cands = np.unique(scores)
    accs = [np.mean((scores >= t) == member) for t in cands]
    return float(cands[int(np.argmax(accs))])


class ShadowAttack:
    """Shokri's attack model(s) trained on shadow records; plus the loss-threshold attack."""

    def __init__(self, shadow: list[Records], per_class: bool, n_classes: int, seed: int = 0):
        self.per_class = per_class
        probs = np.concatenate([r.probs for r in shadow])
        labels = np.concatenate([r.labels for r in shadow])
        member = np.concatenate([r.member for r in shadow]).astype(float)
        self.models: dict[int, AttackMLP] = {}
        if per_class:
            for c in range(n_classes):
                m = labels == c
                if m.sum() >= 4 and len(np.unique(member[m])) == 2:
                    self.models[c] = _fit_mlp(np.log(np.clip(probs[m], 1e-12, None)), member[m], seed + c)
        self.pooled = _fit_mlp(_aligned(probs, labels), member, seed)
        neg_loss = -np.concatenate([r.losses for r in shadow])
        self.loss_threshold = _best_threshold(neg_loss, member.astype(bool))

    def scores(self, rec: Records) -> np.ndarray:
        out = _score_mlp(self.pooled, _aligned(rec.probs, rec.labels))
        if self.per_class:
            for c, model in self.models.items():  # classes without a shadow model keep the pooled score
                m = rec.labels == c
                if m.any():
                    out[m] = _score_mlp(model, np.log(np.clip(rec.probs[m], 1e-12, None)))
        return out

    def evaluate(self, targets: list[Records]) -> dict:
        per_client: dict[str, dict[str, Any]] = {}
        for rec in targets:
            per_client[rec.client] = {
                "shokri": attack_metrics(self.scores(rec), rec.member, 0.5),
                "loss-threshold": attack_metrics(-rec.losses, rec.member, self.loss_threshold),
                "train-test-gap": float(rec.losses[~rec.member].mean() - rec.losses[rec.member].mean()),
            }
        pooled = Records(
            np.concatenate([r.probs for r in targets]),
            np.concatenate([r.labels for r in targets]),
            np.concatenate([r.member for r in targets]),
            "all",
        )
        summary: dict[str, dict[str, Any]] = {}
        for name in ("shokri", "loss-threshold"):
            vals = [v[name] for v in per_client.values()]
            summary[name] = {
                k: float(np.nanmean([v[k] for v in vals])) for k in ("accuracy", "auc", TPR1, TPR1 + "-chance")
            }
        summary["shokri"]["pooled"] = attack_metrics(self.scores(pooled), pooled.member, 0.5)
        summary["loss-threshold"]["pooled"] = attack_metrics(-pooled.losses, pooled.member, self.loss_threshold)
        return {"summary": summary, "per_client": per_client}


# ---- attacks from reference models (LiRA, RMIA; attacks.likelihood) -------------------------------
OFFLINE_ATTACKS = ("lira-offline", "rmia-offline")
ONLINE_ATTACKS = ("lira-online",)


@dataclass
class References:
    """A target client's records under reference models. ``offline``: models that never saw them
    (the shadow federations' client of the same partition, trained on disjoint shadow data);
    ``online``: models of the online reference federations (the same partition, trained on a
    half of the candidates), each with ``inside`` [n], which of the target's records it trained on."""

    offline: list[Records]
    online: list[Records]
    inside: list[np.ndarray]


def reference_scores(target: Records, refs: References) -> dict[str, np.ndarray]:
    """LiRA and RMIA scores of a target client's records (higher = member). RMIA's population: the
    client's non-member records, each compared with all but itself."""
    rows, labels = np.arange(len(target.labels)), target.labels
    ref_probs = np.stack([r.probs for r in refs.offline])  # [R, n, C]
    p_x, p_x_out = target.probs[rows, labels], ref_probs[:, rows, labels]
    pop = ~target.member
    x_in_z = np.where(pop, np.cumsum(pop) - 1, -1)
    phi = logit_confidence(target.probs, labels)
    scores = {
        "lira-offline": lira_offline(phi, logit_confidence(ref_probs, labels)),
        "rmia-offline": rmia(p_x, p_x_out, p_x[pop], p_x_out[:, pop], x_in_z=x_in_z),
    }
    if refs.online:
        phis = np.stack([logit_confidence(r.probs, labels) for r in refs.online])  # [R, n]
        inside = np.stack(refs.inside)
        scores["lira-online"] = lira_online(phi, np.where(inside, phis, np.nan), np.where(inside, np.nan, phis))
    return scores


def interval_summary(scores: dict[str, dict[str, np.ndarray]], member: dict[str, np.ndarray], seed: int) -> dict:
    """``scores[client][attack]`` (higher = member) with ``member[client]``: per client and pooled
    over clients, AUC and TPR at 0.1% and 1% FPR, each with its bootstrap 95% interval; the
    summary's plain figures are the per-client means."""
    per_client = {c: {k: bootstrap(v, member[c], seed=seed) for k, v in by.items()} for c, by in scores.items()}
    clients = list(scores)
    summary: dict[str, dict[str, Any]] = {}
    for k in scores[clients[0]] if clients else ():
        metrics = [per_client[c][k] for c in clients]
        summary[k] = {m: float(np.mean([x[m]["value"] for x in metrics])) for m in metrics[0]}
        summary[k]["pooled"] = bootstrap(
            np.concatenate([scores[c][k] for c in clients]), np.concatenate([member[c] for c in clients]), seed=seed
        )
    return {"summary": summary, "per_client": per_client}


def evaluate_reference_attacks(targets: list[Records], references: dict[str, References], seed: int) -> dict:
    """LiRA and RMIA per client and pooled (``interval_summary``)."""
    scores = {rec.client: reference_scores(rec, references[rec.client]) for rec in targets}
    return interval_summary(scores, {rec.client: rec.member for rec in targets}, seed)
