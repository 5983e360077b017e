"""pFedMoAP's client (docs/methods.md, "pFedMoAP"): a prompt trained from the aggregate every round,
mixed with the expert prompts of other nodes by a private attention gate.

A round with experts:
- the prompt starts from the received aggregate P_g, with a fresh optimiser;
- the experts' text features are computed once, without gradients;
- the gate (``models.gating``) comes from the node's private state, or is built (seeded) at the
  node's first round with experts; its optimiser state persists privately too;
- every batch: logits = s <pool(I), T_MoE> + lambda s cos(I, T_local); the prompt and the gate
  take one step each, with their own optimisers and learning rates (one loop: ``trainer``);
- the reply is the trained prompt only. The gate and its optimiser state never leave the node.

A round without experts (first participation, or K = 0) is a plain CoOp round from P_g.

DP (``pfedmoap.dp-placement``): 'step' runs DP-SGD on both the prompt and the gate at every
step (two clip groups, one noise level); 'upload' trains without noise and clips and noises the
prompt's update once before it is sent (the 'upload' placement is the local mechanism's
``per_participation``, which ``PromptClient.release`` applies).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fedvlm.client_app.prompt_clients import PromptClient, PromptRound
from fedvlm.client_app.scoring import PromptScorer
from fedvlm.client_app.state import optimizer_tensors, restore_optimizer
from fedvlm.client_app.trainer import StepOutput
from fedvlm.models.gating import AttentionGate, moe_logits
from fedvlm.models.prompt_learner import clip_logits
from fedvlm.runconfig import RunConfig
from fedvlm.tensor_names import CTX, EXPERTS
from fedvlm.utils.rng import NodeStream, generator_for, node_key

GATE = "gate."  # the gate's weights, in the node's private state and in a published model
GATE_OPT = "gate-opt."  # the gate's optimiser state (private only)


def build_gate(embed_dim: int, cfg: RunConfig) -> AttentionGate:
    m = cfg.pfedmoap
    return AttentionGate(embed_dim, m.gating_dim, m.gating_heads, m.attention_scale)


class MoAPScorer(PromptScorer):
    """Logits of a personalised pFedMoAP model {ctx, experts, gate.*}: through the gate when it
    has experts and a gate, plain CLIP logits of ``ctx`` otherwise."""

    def gate(self, prompts: dict[str, torch.Tensor]) -> AttentionGate | None:
        weights = {k[len(GATE) :]: v for k, v in prompts.items() if k.startswith(GATE)}
        if not weights:
            return None
        gate = build_gate(self.bundle.embed_dim, self.cfg)
        gate.load_state_dict(weights)
        return gate.to(self.bundle.device)

    @torch.no_grad()
    def expert_text(self, experts: torch.Tensor) -> torch.Tensor:
        """experts [K, ...ctx shape] -> their text features [K, C, D]."""
        experts = experts.to(self.bundle.device)
        return self.encoder(experts[0]).encode_many(experts)

    def logits(self, prompts, feats):
        local = self.text(prompts[CTX])  # [C, D]
        experts, gate = prompts.get(EXPERTS), self.gate(prompts)
        if experts is None or len(experts) == 0 or gate is None:
            return clip_logits(feats, local, self.scale)
        lam = self.cfg.pfedmoap.lambda_
        return moe_logits(gate, feats, local, self.expert_text(experts), self.scale, lam)


class PFedMoAPClient(PromptClient):
    scorer_class = MoAPScorer
    scorer: MoAPScorer  # built from scorer_class in PromptClient.__init__
    keeps_prompt_optimizer = False  # the prompt restarts from P_g with a fresh optimiser each round

    # ---- the gate --------------------------------------------------------------------------
    def load_gate(self) -> AttentionGate:
        weights = {k[len(GATE) :]: v for k, v in self.own.items() if k.startswith(GATE)}
        if weights:
            gate = build_gate(self.bundle.embed_dim, self.cfg)
            gate.load_state_dict(weights)
        else:  # the node's first round with experts: seeded per node
            seed = int(generator_for(node_key(self.cfg.seed, self.node.seed, NodeStream.GATE_INIT)).initial_seed())
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                gate = build_gate(self.bundle.embed_dim, self.cfg)
        return gate.to(self.bundle.device)

    def gate_optimizer(self, gate: AttentionGate) -> torch.optim.Optimizer:
        m, p = self.cfg.pfedmoap, self.cfg.prompt
        params = list(gate.parameters())
        if m.gating_optimizer == "adam":
            opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=m.gating_lr, weight_decay=p.weight_decay)
        else:
            opt = torch.optim.SGD(params, lr=m.gating_lr, momentum=p.momentum, weight_decay=p.weight_decay)
        restore_optimizer(opt, {k: v.to(self.bundle.device) for k, v in self.own.items()}, prefix=GATE_OPT)
        return opt

    # ---- a round ------------------------------------------------------------------------------
    def begin_round(self, arrays, instruction) -> PromptRound:
        """A round from the received aggregate; with experts, the gate trains beside the prompt."""
        experts = arrays.get(EXPERTS)
        if experts is None or len(experts) == 0:
            return self.prompt_round(arrays)
        gate = self.load_gate()
        gate_opt = self.gate_optimizer(gate)
        expert_text = self.scorer.expert_text(experts)  # [K, C, D], no gradient
        plain = self.prompt_round(arrays)
        return MoAPRound(plain, gate, gate_opt, expert_text)

    def finish_round(self, session, stats, shape, sigma, instruction):
        """The gate and its optimiser state stay on the node; the prompt leaves it (noised once
        first with ``dp-placement='upload'``, ``PromptClient.release``)."""
        if isinstance(session, MoAPRound):
            self.own.update({GATE + k: v.detach().cpu() for k, v in session.gate.state_dict().items()})
            self.own.update({k: v.cpu() for k, v in optimizer_tensors(session.gate_opt, prefix=GATE_OPT).items()})
        return super().finish_round(session, stats, shape, sigma, instruction)

    # ---- evaluation ---------------------------------------------------------------------------
    def personal_prompts(self, arrays):
        """What this node evaluates with and publishes: its pool prompt, its experts, its gate."""
        prompts = {CTX: arrays[CTX]}
        if EXPERTS in arrays:
            prompts[EXPERTS] = arrays[EXPERTS]
        prompts.update({k: v for k, v in self.own.items() if k.startswith(GATE)})
        return prompts


class MoAPRound(PromptRound):
    """A pFedMoAP round with experts: the prompt's round (``PromptRound``) plus the private gate,
    which takes its own optimiser step on every batch; logits are the gated mixture
    (``models.gating.moe_logits``)."""

    def __init__(
        self, plain: PromptRound, gate: AttentionGate, gate_opt: torch.optim.Optimizer, expert_text: torch.Tensor
    ):
        super().__init__(plain.client, plain.start, plain.ctx, plain.opt, plain.encoder, plain.feats, plain.labels)
        self.gate = gate
        self.gate_opt = gate_opt
        self.expert_text = expert_text  # [K, C, D] the experts' class text features, no gradient
        self.gate_names = [GATE + k for k, _ in gate.named_parameters()]

    def begin_step(self) -> dict[str, torch.Tensor]:
        return {CTX: self.ctx, **{GATE + k: p for k, p in self.gate.named_parameters()}}

    def forward(self, batch: np.ndarray) -> StepOutput:
        client = self.client
        text = self.encoder(self.ctx)  # [C, D]
        feats = client.batch_features(batch, self.feats)
        logits = moe_logits(self.gate, feats, text, self.expert_text, client.scale, client.cfg.pfedmoap.lambda_)
        y = self.labels[batch]
        return StepOutput(
            F.cross_entropy(logits, y, reduction="none"),
            [text],
            direct=self.gate_names,
            correct=int((logits.argmax(1) == y).sum()),
        )

    def clip_groups(self, names):
        """The prompt and the gate are clipped to C separately (a two-tensor mechanism)."""
        return ((CTX,), tuple(k for k in names if k.startswith(GATE)))

    def apply(self, grads: dict[str, torch.Tensor]) -> None:
        super().apply(grads)
        self.gate_opt.zero_grad(set_to_none=True)
        for k, p in self.gate.named_parameters():
            p.grad = grads[GATE + k]
        self.gate_opt.step()
