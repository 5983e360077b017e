"""The honest-but-curious server's membership attack on every upload of every round.

Threat: the server of a run holds the public backbone, what it sent every sampled client and what
that client uploaded, in every round (kept with ``attack.observe-uploads``, ``server_app.observer``),
and, as in every membership game, the candidate records it must judge (``data/membership.py``).
What an upload is depends on the method; its client class says how the server reads it
(``server_view``): the global prompt's gradient (DP-FPL, FedOTP, FedPGP) or the trained prompt
(PromptFL, pFedMoAP).

Two scores, from the same per-record gradients: for client c in round r, d_r is c's descent
direction in the uploaded tensor and g_r(x) the gradient of record x's loss at the prompts the
server sent, through the method's own scorer with what the server knows (a client's private local
prompt is not among it).

- alignment: s(x) = mean over the rounds c trained of cos(d_r, -g_r(x)). A member's gradient is
  one of the terms d_r is made of; a non-member's correlates with them only through the task.
  Robust to a non-linear optimiser (Adam's update is not a sum of gradients).
- decomposition: the server explains -d_r as a non-negative combination of the candidates'
  gradients (non-negative least squares); a record's share of the weights, averaged over rounds.
  Where the upload is linear in the batch's gradients (one SGD step, DP-FPL's averaged gradient)
  this recovers the round's batch: a member used in the round gets weight, one not used cannot
  be told from a non-member, so the attack's reach is the fraction of members the rounds used.

Local-DP noise added to d_r on the client drowns the member's term; noise the server adds after it
has seen d_r (DP-FPL's global DP) does not, and DP-FPL's ledger says so (its trusted-server note).

Attacks, higher = member:
- ``server-alignment`` and ``server-decomposition``: the scores as they are, no references;
- ``server-lira-offline``: the alignment calibrated by its values for the same records under the
  shadow federations' uploads of the same partition (references that never saw them), LiRA's
  one-sided Gaussian test (``attacks.likelihood``) on it in place of a logit;
- ``server-lira-online``: under the online reference federations' uploads, x in half of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import nnls

from fedvlm.attacks.likelihood import lira_offline, lira_online
from fedvlm.client_app.node import node_data
from fedvlm.client_app.scoring import PromptScorer, UploadView
from fedvlm.data.membership import membership_candidates
from fedvlm.methods.registry import get_method
from fedvlm.models.clip_loader import load_clip
from fedvlm.runconfig import RunConfig
from fedvlm.server_app.observer import load_rounds

ATTACKS = ("server-alignment", "server-decomposition", "server-lira-offline", "server-lira-online")


@dataclass
class Candidates:
    """One client's membership candidates as the scorer takes them: members first."""

    feats: torch.Tensor  # what the scorer's logits take, [2k, ...]
    labels: torch.Tensor  # [2k]
    member: np.ndarray  # [2k] bool


def record_gradients(
    scorer: PromptScorer, view: UploadView, feats: torch.Tensor, labels: torch.Tensor, chunk: int = 32
) -> torch.Tensor:
    """[n, numel]: each record's loss gradient w.r.t. ``view.leaf`` at ``view.prompts``, the
    records ``chunk`` at a time, each chunk in one batched backward pass."""
    dev = scorer.bundle.device
    leaf = view.prompts[view.leaf].to(dev).detach().clone().requires_grad_(True)
    prompts = {k: v.to(dev) for k, v in view.prompts.items()} | {view.leaf: leaf}
    out = []
    for start in range(0, len(labels), chunk):
        logits = scorer.logits(prompts, feats[start : start + chunk].to(dev))
        losses = F.cross_entropy(logits, labels[start : start + chunk].to(dev), reduction="none")
        eye = torch.eye(len(losses), device=dev, dtype=losses.dtype)
        (grads,) = torch.autograd.grad(losses, [leaf], grad_outputs=eye, is_grads_batched=True)
        out.append(grads.flatten(1).detach().cpu())
    return torch.cat(out)


class AlignmentScorer:
    """Scores a run's candidates (the target's, whichever federation's uploads are read)."""

    def __init__(self, cfg: RunConfig, num_partitions: int, seed: int):
        self.cfg, self.n, self.seed = cfg, num_partitions, seed
        self.client = get_method(cfg.method).client
        self.bundle = load_clip(cfg.clip.model, cfg.clip.pretrained, cfg.cache_path, cfg.device)
        self._scorer: PromptScorer | None = None
        self._candidates: dict[int, Candidates] = {}

    def candidates(self, pid: int) -> Candidates:
        if pid not in self._candidates:
            node = node_data(self.cfg, {"partition-id": pid, "num-partitions": self.n})
            if self._scorer is None:
                self._scorer = self.client.scorer_class(self.bundle, node.splits.classnames, self.cfg)
            members, non_members = membership_candidates(node.part, self.seed, pid)
            feats, labels = [], []
            for split, idx in ((node.splits.train, members), (node.splits.test, non_members)):
                feats.append(self._scorer.image_features(split, idx, self.cfg.cache_path).cpu())
                labels.append(torch.as_tensor(split.labels[idx], dtype=torch.long))
            k = len(members)
            member = np.r_[np.ones(k, bool), np.zeros(k, bool)]
            self._candidates[pid] = Candidates(torch.cat(feats), torch.cat(labels), member)
        return self._candidates[pid]

    def scores(self, run_dir: Path) -> dict[int, dict[str, np.ndarray]]:
        """Partition id -> {"alignment", "decomposition"}: [2k] scores of its candidates under
        ``run_dir``'s recorded uploads, each the mean over the rounds that partition's client uploaded."""
        total: dict[int, dict[str, np.ndarray]] = {}
        rounds: dict[int, int] = {}
        for rnd in load_rounds(run_dir):
            for name, uploaded in rnd.uploaded.items():
                pid = rnd.partition.get(name, -1)
                if pid < 0 or not uploaded:  # a node with its own data-dir: its records are not candidates
                    continue
                cand = self.candidates(pid)
                view = self.client.server_view(rnd.sent[name], uploaded)
                assert self._scorer is not None  # built with the first candidates
                grads = record_gradients(self._scorer, view, cand.feats, cand.labels).double()  # [2k, numel]
                descent = view.descent.flatten().double()
                weights, _ = nnls(grads.T.numpy(), -descent.numpy())
                round_scores = {
                    "alignment": F.cosine_similarity(-grads, descent[None, :], dim=1, eps=1e-30).numpy(),
                    "decomposition": weights / max(weights.sum(), 1e-300),
                }
                acc = total.setdefault(pid, {k: np.zeros(len(cand.member)) for k in round_scores})
                for k, v in round_scores.items():
                    acc[k] += v
                rounds[pid] = rounds.get(pid, 0) + 1
        if not total:
            raise ValueError(
                f"no client of {run_dir} uploaded a tensor the server could read: method {self.cfg.method!r} "
                "shares nothing with the server, so it has nothing to attack"
            )
        return {pid: {k: v / rounds[pid] for k, v in acc.items()} for pid, acc in total.items()}


def server_scores(
    target: dict[str, np.ndarray],
    offline: list[dict[str, np.ndarray]],
    online: list[dict[str, np.ndarray]],
    inside: list[np.ndarray],
) -> dict[str, np.ndarray]:
    """One client's attack scores from its candidates' scores (``AlignmentScorer.scores``) under the
    target, under the shadow federations (``offline``) and under the online references (``online``
    with ``inside``, which candidates each trained on)."""
    out = {"server-alignment": target["alignment"], "server-decomposition": target["decomposition"]}
    if offline:
        out["server-lira-offline"] = lira_offline(target["alignment"], np.stack([o["alignment"] for o in offline]))
    if online:
        phis, ins = np.stack([o["alignment"] for o in online]), np.stack(inside)
        out["server-lira-online"] = lira_online(
            target["alignment"], np.where(ins, phis, np.nan), np.where(ins, np.nan, phis)
        )
    return out
