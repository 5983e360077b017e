"""Clients of the global/local prompt methods: DP-FPL and its baselines (FedOTP, FedPGP).

All share one round (``GlobalLocalRound``, whose hooks ``client_app.trainer`` runs),
which is DP-FPL's Algorithm 1 generalised to ``local-steps`` steps per round:
- the global prompt p_G arrives from the server; the local part stays in the node's private
  state and never leaves it;
- every step: sample a batch, build the method's forward from p_G and the local leaves,
  compute per-sample (or per-batch) clipped gradients of every leaf, add local-DP noise to
  the local leaves' gradients only, update the local part, and accumulate p_G's clipped
  gradient;
- the reply is p_G's gradient (averaged over the round's steps and clipped to C); the server
  averages, adds global-DP noise and steps p_G.
With ``dpfpl.global-update = local`` (FedOTP's and FedPGP's own FedAvg, without privacy) the
client also steps p_G with its local optimiser every step and replies start minus end, which
the server's step (server-lr 1, sgd) turns into the clients' mean prompt.

Methods differ in ``local_leaves`` (what is trained locally and noised), ``score`` (how p_G
and the local part make logits) and ``apply_local`` (how the local part is updated).
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from fedvlm.client_app.prompt_clients import PromptClient
from fedvlm.client_app.scoring import OTScorer
from fedvlm.client_app.server_view import UploadView
from fedvlm.client_app.state import optimizer_tensors, restore_optimizer
from fedvlm.client_app.trainer import Learner, StepOutput
from fedvlm.models.lowrank import factorize, rebuild_gradient
from fedvlm.models.prompt_learner import clip_logits
from fedvlm.privacy.mechanisms import clip_tensor
from fedvlm.protocol import TrainReply
from fedvlm.tensor_names import CTX, GLOBAL_CTX, GLOBAL_GRAD
from fedvlm.utils.rng import NodeStream, generator_for, node_key


class GlobalLocalClient(PromptClient):
    local_name = "local_ctx"  # the private tensor kept in context.state

    # ---- method hooks ---------------------------------------------------------------------
    def init_local(self, global_ctx: torch.Tensor) -> dict[str, torch.Tensor]:
        """The private local part at first contact: N(0, init-std^2), seeded per node."""
        gen = generator_for(node_key(self.cfg.seed, self.node.seed, NodeStream.LOCAL_INIT))
        return {self.local_name: torch.randn(global_ctx.shape, generator=gen) * self.cfg.prompt.init_std}

    def local_leaves(self, local: dict[str, torch.Tensor], step_gen: torch.Generator) -> tuple[dict, dict]:
        """(leaves, context): the locally trained tensors of this step (each gets local-DP
        noise) and whatever ``score``/``apply_local`` need besides."""
        raise NotImplementedError

    def score(self, p_global: torch.Tensor, leaves: dict, ctx: dict, feats: torch.Tensor, labels: torch.Tensor):
        """(per-sample losses, logits, text features the leaves reach the losses through)."""
        raise NotImplementedError

    def apply_local(self, local: dict, leaves: dict, ctx: dict, grads: dict, opt) -> None:
        raise NotImplementedError

    def personal_prompt(self, p_global: torch.Tensor, local: dict[str, torch.Tensor]) -> torch.Tensor:
        """The prompt this client evaluates (and publishes)."""
        raise NotImplementedError

    def local_opt_params(self, local: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [local[self.local_name]]

    def regularizer(self, p_global: torch.Tensor, leaves: dict, ctx: dict, forward_out) -> torch.Tensor | None:
        """A data-independent loss term (e.g. FedPGP's prompt contrast). Its gradient is added
        after clipping and noise: it reveals nothing about the data and costs no privacy."""
        return None

    @staticmethod
    def server_prompts(p_global: torch.Tensor) -> tuple[dict[str, torch.Tensor], str]:
        """(prompts, the global prompt's key): the model the server can score with, the private
        local part at its mean initial value, zero."""
        return {CTX: p_global}, CTX

    @classmethod
    def server_view(cls, sent, uploaded, known):
        """The upload is the global prompt's gradient: the descent is its negative."""
        prompts, leaf = cls.server_prompts(sent[GLOBAL_CTX])
        return UploadView(prompts, {leaf: -uploaded[GLOBAL_GRAD]})

    # ---- shared machinery -------------------------------------------------------------------
    def load_local(self, global_ctx: torch.Tensor) -> dict[str, torch.Tensor]:
        keys = [k for k in self.own if not k.startswith("opt.")]  # everything but optimiser state
        if not keys:
            return {k: v.to(self.bundle.device) for k, v in self.init_local(global_ctx).items()}
        return {k: self.own[k].to(self.bundle.device) for k in keys}

    def store_local(self, local: dict[str, torch.Tensor]) -> None:
        self.own.update({k: v.detach().cpu() for k, v in local.items()})

    def begin_round(self, arrays, instruction) -> GlobalLocalRound:
        feats, labels = self.features("train")
        dev = self.bundle.device
        p_global = arrays[GLOBAL_CTX].to(dev)
        local = self.load_local(p_global)
        for t in local.values():
            t.requires_grad_(True)
        opt = self.make_optimizer(self.local_opt_params(local))
        restore_optimizer(opt, {k: v.to(dev) for k, v in self.own.items()})
        factors = generator_for(node_key(self.cfg.seed, self.node.seed, NodeStream.POWER_ITERATION, self.round))
        stepped = None
        if self.cfg.dpfpl.global_update == "local":  # its own optimiser, fresh each round, as FedAvg's clients
            stepped = torch.nn.Parameter(p_global.clone())
            stepped_opt = self.make_optimizer([stepped])
        session = GlobalLocalRound(self, p_global, local, opt, factors, feats, labels)
        if stepped is not None:
            session.step_global = (stepped, stepped_opt)
        return session

    def finish_round(self, session, stats, shape, sigma, instruction):
        if session.step_global is not None:  # start minus end: the server's step with lr 1 lands on their mean
            upload = session.p_start - session.p_global
        else:
            upload = session.g_global / shape.steps
            if self.privacy.enabled:  # the average of clipped steps has norm <= C; clip again for safety
                upload, _ = clip_tensor(upload, self.privacy.clip)
        self.store_local({k: v.detach() for k, v in session.local.items()})
        self.own.update({k: v.cpu() for k, v in optimizer_tensors(session.opt).items()})
        return TrainReply({GLOBAL_GRAD: upload.cpu()}, self.train_metrics(stats, session))

    def personal_prompts(self, arrays):
        p_global = arrays[GLOBAL_CTX].to(self.bundle.device)
        local = self.load_local(p_global)
        self.store_local(local)  # first contact: keep the initial local part
        return self.published_prompts(p_global, local)

    def published_prompts(self, p_global: torch.Tensor, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {CTX: self.personal_prompt(p_global, local)}


class GlobalLocalRound(Learner):
    """One round of a global/local method: the ``Learner`` hooks of ``client_app.trainer`` on the
    received global prompt, the private local part and the round's sum of p_G's gradients; the
    method's own forward and update are its client's hooks (``local_leaves``, ``score``,
    ``regularizer``, ``apply_local``)."""

    def __init__(
        self,
        client: GlobalLocalClient,
        p_global: torch.Tensor,
        local: dict[str, torch.Tensor],
        opt: torch.optim.Optimizer,
        factors: torch.Generator,
        feats: torch.Tensor,
        labels: torch.Tensor,
    ):
        self.client = client
        self.p_global = p_global  # [M, d] the global prompt this step starts from (the received one
        # all round, unless ``step_global``: dpfpl.global-update = local steps it on the node)
        self.p_start = p_global
        self.step_global: tuple[torch.nn.Parameter, torch.optim.Optimizer] | None = None
        self.local = local  # the private local part, trained (DP-FPL's p_L, FedPGP's u and v)
        self.opt = opt  # the local part's optimiser
        self.factors = factors  # DP-FPL's power iterations, keyed by the node and round
        self.feats, self.labels = feats, labels  # [n, D] the node's cached training features; [n]
        self.g_global = torch.zeros_like(p_global)  # the sum of p_G's clipped step gradients
        # this step's: the local leaves, what score/apply_local need besides, p_G's leaf, the text
        # features the leaves reach the losses through
        self.leaves: dict[str, torch.Tensor] = {}
        self.step_ctx: dict = {}
        self.g_leaf = p_global
        self.via: list[torch.Tensor] = []

    def begin_step(self) -> dict[str, torch.Tensor]:
        self.leaves, self.step_ctx = self.client.local_leaves(self.local, self.factors)
        self.g_leaf = self.p_global.clone().requires_grad_(True)
        return {"global": self.g_leaf, **self.leaves}

    def forward(self, batch: np.ndarray) -> StepOutput:
        y = self.labels[batch]
        losses, logits, self.via = self.client.score(self.g_leaf, self.leaves, self.step_ctx, self.feats[batch], y)
        return StepOutput(losses, self.via, correct=int((logits.detach().argmax(1) == y).sum()))

    def noised(self, names):
        return frozenset(names) - {"global"}  # p_G's gradient is noised on the server (global DP)

    def extra_gradients(self) -> dict[str, torch.Tensor]:
        reg = self.client.regularizer(self.g_leaf, self.leaves, self.step_ctx, self.via)
        if reg is None:
            return {}
        names = ["global", *self.leaves]
        extra = torch.autograd.grad(reg, [self.g_leaf, *self.leaves.values()], allow_unused=True)
        return {k: g for k, g in zip(names, extra, strict=True) if g is not None}

    def apply(self, grads: dict[str, torch.Tensor]) -> None:
        g = grads.pop("global")
        self.g_global += g
        if self.step_global is not None:
            param, opt = self.step_global
            opt.zero_grad(set_to_none=True)
            param.grad = g
            opt.step()
            self.p_global = param.detach().clone()
        self.client.apply_local(self.local, self.leaves, self.step_ctx, grads, self.opt)


class DPFPLClient(GlobalLocalClient):
    """DP-FPL: p = p_G + u v + r with (u, v, r) from a rank-k power iteration of the private
    full-rank local prompt every step; local DP on the gradients of u and v; the local
    prompt's gradient rebuilt by eq. 4 (``models.lowrank``). ``dpfpl.rank = 0``: no
    factorisation, local DP on the full local prompt's gradient."""

    def local_leaves(self, local, step_gen):
        p_local = local[self.local_name]
        rank = self.cfg.dpfpl.rank
        if rank == 0:
            return {"local": p_local.detach().clone().requires_grad_(True)}, {}
        u, v, r = factorize(p_local, rank, step_gen)
        return {"u": u.requires_grad_(True), "v": v.requires_grad_(True)}, {"u": u.detach(), "v": v.detach(), "r": r}

    def score(self, p_global, leaves, ctx, feats, labels):
        if "local" in leaves:
            prompt = p_global + leaves["local"]
        else:
            prompt = p_global + leaves["u"] @ leaves["v"]
            if self.cfg.dpfpl.residual:
                prompt = prompt + ctx["r"]  # a constant: no gradient flows into r
        text = self.encoder(prompt)(prompt)
        logits = clip_logits(feats, text, self.scale)
        return F.cross_entropy(logits, labels, reduction="none"), logits, [text]

    def apply_local(self, local, leaves, ctx, grads, opt):
        p_local = local[self.local_name]
        if "local" in grads:
            g = grads["local"]
        else:
            g = rebuild_gradient(grads["u"], grads["v"], ctx["u"], ctx["v"])
        opt.zero_grad(set_to_none=True)
        p_local.grad = g
        opt.step()

    def personal_prompt(self, p_global, local):
        p_local = local[self.local_name]
        rank = self.cfg.dpfpl.rank
        if rank == 0 or self.cfg.dpfpl.residual:
            return p_global + p_local  # u v + r = p_L exactly
        # no-residual ablation: the forward only ever sees the rank-k part
        u, v, _ = factorize(
            p_local,
            rank,
            generator_for(node_key(self.cfg.seed, self.node.seed, NodeStream.ABLATION_FACTOR, self.round)),
        )
        return p_global + u @ v


class FedOTPClient(GlobalLocalClient):
    """FedOTP: a global and a full-rank local prompt; each class scores an image by unbalanced
    optimal transport between the image's patch embeddings and the class's two prompt
    features (``client_app.scoring.OTScorer``). Local DP on the local prompt's gradient."""

    scorer_class = OTScorer

    @staticmethod
    def server_prompts(p_global):
        return {"global": p_global, "local": torch.zeros_like(p_global)}, "global"

    def local_leaves(self, local, step_gen):
        return {"local": local[self.local_name].detach().clone().requires_grad_(True)}, {}

    def score(self, p_global, leaves, ctx, feats, labels):
        text = torch.stack([self.scorer.text(p_global), self.scorer.text(leaves["local"])])
        logits = self.scorer.ot_logits(feats, text)
        return F.cross_entropy(logits, labels, reduction="none"), logits, [text]

    def apply_local(self, local, leaves, ctx, grads, opt):
        opt.zero_grad(set_to_none=True)
        local[self.local_name].grad = grads["local"]
        opt.step()

    def published_prompts(self, p_global, local):
        return {"global": p_global, "local": local[self.local_name]}


class FedPGPClient(GlobalLocalClient):
    """FedPGP: p = p_G + u v with low-rank u (M x k), v (k x d) trained directly, factorised
    once from the initial local prompt (no residual, no refactorisation); plus a prompt-wise
    contrastive term that keeps the global prompt's class features near CLIP's hand-written
    prompt's and away from the personalised ones. Local DP on the gradients of u and v."""

    def init_local(self, global_ctx):
        p_local = super().init_local(global_ctx)[self.local_name]
        u, v, _ = factorize(
            p_local,
            self.cfg.fedpgp.rank,
            generator_for(node_key(self.cfg.seed, self.node.seed, NodeStream.PGP_FACTOR_INIT)),
        )
        # u v has unit singular values; scale it to the initial prompt's size so the
        # personalised prompt starts as small a perturbation as the other methods'
        return {"u": u * p_local.norm() / (u @ v).norm(), "v": v}

    def local_opt_params(self, local):
        return [local["u"], local["v"]]

    def local_leaves(self, local, step_gen):
        return {k: local[k].detach().clone().requires_grad_(True) for k in ("u", "v")}, {}

    def score(self, p_global, leaves, ctx, feats, labels):
        text = self.scorer.text(p_global + leaves["u"] @ leaves["v"])
        logits = clip_logits(feats, text, self.scale)
        return F.cross_entropy(logits, labels, reduction="none"), logits, [text]

    @cached_property
    def handcrafted_text(self) -> torch.Tensor:
        """CLIP's text features of the hand-written template, [C, D] (encoded once per client)."""
        template = self.cfg.zeroshot.template
        tokens = self.bundle.tokenizer([template.format(c) for c in self.classnames]).to(self.bundle.device)
        with torch.no_grad():
            text = self.bundle.model.encode_text(tokens)  # type: ignore[operator]  # open_clip, typed as nn.Module
        return F.normalize(text.float(), dim=-1)

    def regularizer(self, p_global, leaves, ctx, via):
        mu = self.cfg.fedpgp.mu
        if mu == 0:
            return None
        tau = self.cfg.fedpgp.temperature
        text_global = self.scorer.text(p_global)
        text_personal = via[0]
        pos = (text_global * self.handcrafted_text).sum(-1) / tau
        neg = (text_global * text_personal).sum(-1) / tau
        return mu * (torch.logsumexp(torch.stack([pos, neg]), 0) - pos).mean()

    def apply_local(self, local, leaves, ctx, grads, opt):
        opt.zero_grad(set_to_none=True)
        local["u"].grad, local["v"].grad = grads["u"], grads["v"]
        opt.step()

    def personal_prompt(self, p_global, local):
        return p_global + local["u"] @ local["v"]
