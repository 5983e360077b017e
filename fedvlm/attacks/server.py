"""The honest-but-curious server's membership attack on every upload of every round.

Threat: the server of a run holds the public backbone, what it sent every sampled client and what
that client uploaded, in every round (kept with ``attack.observe-uploads``, ``server_app.observer``),
and, as in every membership game, the candidate records it must judge (``data/membership.py``).
What an upload is depends on the method; its client class says how the server reads it
(``server_view``): the global prompt's gradient (DP-FPL, FedOTP, FedPGP), the trained prompt
(PromptFL, pFedMoAP), or adapter tensors (the LoRA methods: FedRand's drawn half, FedAvg-LoRA's
whole adapter, FedPer's top layers, FedPara's shared LoHa pair).

Two scores, from the same per-record gradients: for client c in round r, d_r is c's descent
direction in the uploaded tensors and g_r(x) the gradient of record x's loss at the model the
server can build for c that round (``UploadView.model``), through the method's own scorer
(``PromptModel``) or the VLM (``AdapterModel``), with what the server knows: a client's private
local prompt is not among it; a FedRand client's private half is its last upload of that half.

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
from fedvlm.client_app.node_config import NUM_PARTITIONS, PARTITION_ID
from fedvlm.client_app.prompt_clients import PromptClient
from fedvlm.client_app.scoring import PromptScorer
from fedvlm.client_app.server_view import Observed, UploadView
from fedvlm.data.membership import membership_candidates
from fedvlm.models.clip_loader import load_clip
from fedvlm.protocol import SECAGG_MASKED
from fedvlm.runconfig import RunConfig
from fedvlm.server_app.observer import load_rounds
from fedvlm.spec import spec_of

ATTACKS = ("server-alignment", "server-decomposition", "server-lira-offline", "server-lira-online")


@dataclass
class Candidates:
    """One client's membership candidates as the prompt scorer takes them: members first."""

    feats: torch.Tensor  # what the scorer's logits take, [2k, ...]
    labels: torch.Tensor  # [2k]
    member: np.ndarray  # [2k] bool


def record_gradients(
    scorer: PromptScorer, view: UploadView, feats: torch.Tensor, labels: torch.Tensor, chunk: int = 32
) -> torch.Tensor:
    """[n, numel]: each record's loss gradient w.r.t. the tensors ``view.descent`` names (in its
    order, flattened) at the prompts ``view.model``, the records ``chunk`` at a time, each chunk in
    one batched backward pass."""
    dev = scorer.bundle.device
    leaves = {k: view.model[k].to(dev).detach().clone().requires_grad_(True) for k in view.descent}
    prompts = {k: v.to(dev) for k, v in view.model.items()} | leaves
    out = []
    for start in range(0, len(labels), chunk):
        logits = scorer.logits(prompts, feats[start : start + chunk].to(dev))
        losses = F.cross_entropy(logits, labels[start : start + chunk].to(dev), reduction="none")
        eye = torch.eye(len(losses), device=dev, dtype=losses.dtype)
        grads = torch.autograd.grad(losses, list(leaves.values()), grad_outputs=eye, is_grads_batched=True)
        out.append(torch.cat([g.flatten(1) for g in grads], dim=1).detach().cpu())
    return torch.cat(out)


class PromptModel:
    """Prompt methods: the public CLIP backbone and the method's scorer; a client's candidates are
    ``data/membership.py``'s (the client attacks' records)."""

    def __init__(self, cfg: RunConfig, num_partitions: int, seed: int):
        self.cfg, self.n, self.seed = cfg, num_partitions, seed
        self.bundle = load_clip(cfg.clip.model, cfg.clip.pretrained, cfg.cache_path, cfg.device)
        self.scorer: PromptScorer | None = None
        self._candidates: dict[int, Candidates] = {}

    def candidates(self, pid: int) -> Candidates:
        if pid not in self._candidates:
            node = node_data(self.cfg, {PARTITION_ID: pid, NUM_PARTITIONS: self.n})
            if self.scorer is None:
                client = spec_of(self.cfg).client
                assert issubclass(client, PromptClient)  # a prompt method's run (ServerAttack picks this model)
                self.scorer = client.scorer_class(self.bundle, node.splits.classnames, self.cfg)
            members, non_members = membership_candidates(node.part, self.seed, pid)
            feats, labels = [], []
            for split, idx in ((node.splits.train, members), (node.splits.test, non_members)):
                feats.append(self.scorer.image_features(split, idx, self.cfg.cache_path).cpu())
                labels.append(torch.as_tensor(split.labels[idx], dtype=torch.long))
            k = len(members)
            member = np.r_[np.ones(k, bool), np.zeros(k, bool)]
            self._candidates[pid] = Candidates(torch.cat(feats), torch.cat(labels), member)
        return self._candidates[pid]

    def member(self, pid: int) -> np.ndarray:
        return self.candidates(pid).member

    def gradients(self, pid: int, view: UploadView) -> torch.Tensor:
        cand = self.candidates(pid)
        assert self.scorer is not None  # built with the first candidates
        return record_gradients(self.scorer, view, cand.feats, cand.labels)


class AdapterModel:
    """LoRA methods: the frozen VLM with the run's adapter (every tensor the server does not know at
    its seeded initial value); a client's candidates are ``samples`` of its training samples
    (members) and as many of its test samples (non-members), drawn from the seed."""

    def __init__(self, cfg: RunConfig, num_partitions: int, seed: int, samples: int):
        from fedvlm.client_app.vlm_node import vlm_node_data
        from fedvlm.models.vlm import load_vlm

        self.cfg, self.n, self.seed, self.samples = cfg, num_partitions, seed, samples
        self.node_data = vlm_node_data
        self.vlm, self.initial, _ = load_vlm(cfg, spec_of(cfg).adapter)
        self.vlm.model.eval()  # no adapter dropout: the server's gradients are deterministic
        self._records: dict[int, list[tuple]] = {}
        self._member: dict[int, np.ndarray] = {}

    def records(self, pid: int) -> list[tuple]:
        """(split, index) of each candidate, members first."""
        if pid not in self._records:
            node = self.node_data(self.cfg, {PARTITION_ID: pid, NUM_PARTITIONS: self.n})
            rng = np.random.default_rng([self.seed, pid + 1])
            k = min(len(node.train), len(node.test), self.samples)
            members = np.sort(rng.choice(len(node.train), k, replace=False))
            non_members = np.sort(rng.choice(len(node.test), k, replace=False))
            self._records[pid] = [(node.train, int(i)) for i in members] + [(node.test, int(i)) for i in non_members]
            self._member[pid] = np.r_[np.ones(k, bool), np.zeros(k, bool)]
        return self._records[pid]

    def member(self, pid: int) -> np.ndarray:
        self.records(pid)
        return self._member[pid]

    def gradients(self, pid: int, view: UploadView) -> torch.Tensor:
        from fedvlm.models.vlm import load_adapter_state, trainable

        load_adapter_state(self.vlm.model, {**self.initial, **view.model})
        params = trainable(self.vlm.model)
        leaves = [params[k] for k in view.descent]
        rows = []
        for split, i in self.records(pid):  # one sample at a time: a sample's loss is its own
            batch = self.vlm.training_batch([split.images.image(i)], [split.prompts[i]], [split.targets[i]])
            loss = self.vlm.losses(batch)[0][0]
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
            rows.append(
                torch.cat(
                    [
                        (g if g is not None else torch.zeros_like(p)).flatten()
                        for g, p in zip(grads, leaves, strict=True)
                    ]
                ).cpu()
            )
        return torch.stack(rows)


class ServerAttack:
    """Scores a run's candidates (the target's, whichever federation's uploads are read)."""

    def __init__(self, cfg: RunConfig, num_partitions: int, seed: int, samples: int = 100):
        self.cfg, spec = cfg, spec_of(cfg)
        client = spec.client
        if not isinstance(client, Observed):
            raise ValueError(
                f"the server's attack reads prompt and LoRA uploads; {spec.name}'s client says no view of them"
            )
        self.client: Observed = client
        self.model: PromptModel | AdapterModel = (
            AdapterModel(cfg, num_partitions, seed, samples) if spec.adapter else PromptModel(cfg, num_partitions, seed)
        )

    def member(self, pid: int) -> np.ndarray:
        return self.model.member(pid)

    def scores(self, run_dir: Path) -> dict[int, dict[str, np.ndarray]]:
        """Partition id -> {"alignment", "decomposition"}: [2k] scores of its candidates under
        ``run_dir``'s recorded uploads, each the mean over the rounds that partition's client uploaded."""
        total: dict[int, dict[str, np.ndarray]] = {}
        rounds: dict[int, int] = {}
        known: dict[str, dict[str, torch.Tensor]] = {}  # each client's last upload of every tensor
        masked = False
        for rnd in load_rounds(run_dir):
            for name, uploaded in rnd.uploaded.items():
                if SECAGG_MASKED in uploaded:  # secure aggregation: a masked vector, nothing to read
                    masked = True
                    continue
                pid = rnd.partition.get(name, -1)
                before = known.setdefault(name, {})
                view = self.client.server_view(rnd.sent[name], uploaded, dict(before)) if uploaded else None
                before.update(uploaded)
                if pid < 0 or view is None or not view.descent:  # a node with its own data-dir: no candidates
                    continue
                grads = self.model.gradients(pid, view).double()  # [2k, numel]
                descent = torch.cat([d.flatten() for d in view.descent.values()]).double()
                weights, _ = nnls(grads.T.numpy(), -descent.numpy())
                round_scores = {
                    "alignment": F.cosine_similarity(-grads, descent[None, :], dim=1, eps=1e-30).numpy(),
                    "decomposition": weights / max(weights.sum(), 1e-300),
                }
                acc = total.setdefault(pid, {k: np.zeros(len(grads)) for k in round_scores})
                for k, v in round_scores.items():
                    acc[k] += v
                rounds[pid] = rounds.get(pid, 0) + 1
        if not total and masked:
            raise ValueError(
                f"{run_dir} ran with secure aggregation: the server saw each client's update only under its masks "
                f"({SECAGG_MASKED}), uniform to it, and learns nothing of one client but what the round's sum says; "
                "there is no per-client upload to attack"
            )
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
