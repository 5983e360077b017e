"""Client trainers of the LoRA family: FedRand, FedAvg-LoRA, FedPer-LoRA, FedPara-LoRA.

They share ``LoRAClient``: the frozen VLM with its adapter, this node's captioning or VQA
data, the training hooks (AdamW over every adapter tensor, one epoch by default; the loop is
``client_app.trainer``, DP-SGD clips the whole adapter's per-sample gradient as one) and one
evaluation. What differs is only which adapter tensors come from the server, which from the
node's private state, and which may go back:

- FedAvg-LoRA: everything comes from the server and goes back.
- FedRand: the server sends one half (all A or all B; both on a first participation); the
  other half is this node's own trained values from its last round. Both train; the node
  keeps both and sends back only the half the server asked for (``reply-keys``).
- FedPer-LoRA: the top layers' adapters are shared, the rest never leave the node.
- FedPara-LoRA: LoHa's first pair (w1) is shared, the second pair (w2) is the node's own.

The node's adapter tensors live in ``context.state`` between rounds (``client_app.state``);
the send guard refuses any reply tensor outside what the method may share or equal to a
tensor the node has never sent.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager

import numpy as np
import torch

from fedvlm.client_app.client import Client, RequestRefused
from fedvlm.client_app.node_config import NUM_PARTITIONS
from fedvlm.client_app.server_view import UploadView
from fedvlm.client_app.trainer import Learner, StepOutput
from fedvlm.client_app.vlm_node import VLMNodeData
from fedvlm.metrics import CLIENT_MODEL, NUM_EXAMPLES, OOD, OOD_EXAMPLES, SERVER_MODEL, TRAIN_SECONDS, vlm_score
from fedvlm.models import adapter_parts
from fedvlm.models.vlm import load_adapter_state, load_vlm, trainable
from fedvlm.privacy.canaries import Canaries
from fedvlm.protocol import EvaluateInstruction, EvaluateReply, HelloReport, TrainInstruction, TrainReply
from fedvlm.runconfig import RunConfig
from fedvlm.spec import spec_of
from fedvlm.utils.rng import NodeStream, generator_for, node_key
from fedvlm.utils.vlm_metrics import score_split


class LoRAClient(Client):
    """A LoRA method's client: the adapter kind and what it may share come from the method's
    registry entry (``MethodSpec.adapter``, ``MethodSpec.shares``)."""

    node: VLMNodeData

    def __init__(self, cfg: RunConfig, node: VLMNodeData, state, server_round: int, canaries: Canaries | None = None):
        super().__init__(cfg, node, state, server_round, canaries)
        spec = spec_of(cfg)
        self.vlm, self.initial, self.backbone = load_vlm(cfg, spec.adapter)
        self.shareable = sorted(spec.shares(cfg, self.initial))  # every tensor it may ever send

    # --- what is shared ------------------------------------------------------------------------
    @property
    def tensor_names(self) -> frozenset[str]:
        """The adapter's tensors (what the method's sharing rule chooses from)."""
        return frozenset(self.initial)

    @property
    def private(self) -> dict[str, torch.Tensor]:
        """Tensors that must never appear in a reply (the guard compares bytes): the node's own
        values of every tensor it may not share, and of tensors it has not sent since training."""
        sent = set(str(self.meta.get("sent", "")).split(",")) - {""}
        return {k: v for k, v in self.own.items() if k not in self.shareable or k not in sent}

    @staticmethod
    def server_view(
        sent: dict[str, torch.Tensor], uploaded: dict[str, torch.Tensor], known: dict[str, torch.Tensor]
    ) -> UploadView:
        """How the server reads this round's upload (attacks.server): the client's model as far as
        the server can rebuild it, the client's earlier uploads (``known``) under what it sent this
        round (every other tensor at its initial value); the descent is each uploaded tensor's change
        from that (FedRand: the half sent; its private half is the client's last upload of it)."""
        model = {**known, **sent}
        return UploadView(model, {k: v - model[k] for k, v in uploaded.items() if k in model})

    # --- handshake -----------------------------------------------------------------------------
    def hello(self) -> HelloReport:
        n = self.node
        return HelloReport(
            n.name,
            n.partition_id,
            len(n.train),
            len(n.test),
            0,
            n.dataset.n_labels,
            self.backbone,
            n.noise_source,
            dataset=n.train.images.identity,
            classes=",".join(str(c) for c in sorted(set(n.train.labels.tolist()))),
            device=str(self.vlm.device),
        )

    # --- adapter assembly ------------------------------------------------------------------------
    def starting_adapter(self, received: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What this round starts from: the server's tensors where sent, else this node's own
        values, else the seeded initial values (a first participation)."""
        out = dict(self.initial)
        out.update(self.own)
        out.update(received)
        return out

    # --- a round (client_app.client.Client.train) ----------------------------------------------
    def training_records(self) -> int:
        if not len(self.node.train):
            raise RequestRefused(f"{self.node.name} holds no training samples")
        return len(self.node.train)

    def begin_round(self, arrays: dict[str, torch.Tensor], instruction: TrainInstruction) -> LoRARound:
        load_adapter_state(self.vlm.model, self.starting_adapter(arrays))
        params = trainable(self.vlm.model)
        opt = torch.optim.AdamW(list(params.values()), lr=self.cfg.lora.lr, weight_decay=self.cfg.lora.weight_decay)
        return LoRARound(self, params, opt)

    def loop_context(self) -> AbstractContextManager:
        """LoRA dropout draws from torch's global generator: seed it per node and round (and put it
        back after), so a run repeats whatever ran before in the same process; the model trains
        in train mode."""
        return self._seeded_training()

    @contextmanager
    def _seeded_training(self) -> Iterator[None]:
        c = self.cfg
        self.vlm.model.train()
        try:
            with torch.random.fork_rng():
                torch.manual_seed(
                    generator_for(node_key(c.seed, self.node.seed, NodeStream.LORA_DROPOUT, self.round)).initial_seed()
                )
                yield
        finally:
            self.vlm.model.eval()

    def finish_round(self, session, stats, shape, sigma, instruction):
        trained = {k: v.detach().cpu().clone() for k, v in session.params.items()}
        requested = list(instruction.reply_keys)
        self.own = self.keep(trained)
        self.meta["sent"] = ",".join(requested)
        return TrainReply(
            {k: trained[k] for k in requested},
            {**stats.metrics(len(self.node.train)), TRAIN_SECONDS: time.time() - session.started},
        )

    def check_request(self, arrays: dict[str, torch.Tensor], instruction: TrainInstruction) -> None:
        """Refuse a train message that breaks the method's rule on what is exchanged."""
        extra = set(arrays) - set(self.shareable)
        if extra:
            raise RequestRefused(f"the server sent tensors this method keeps on the client: {sorted(extra)[:3]}")

    def keep(self, trained: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the node stores for its next round: everything it trained (its personal model
        is its last trained adapter, and the next round starts from its private part), or
        nothing where it shares every tensor each round (FedAvg: its model is the server's)."""
        return {} if frozenset(self.shareable) == self.tensor_names else trained

    # --- evaluation -------------------------------------------------------------------------------
    def personal_adapter(self, arrays: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The node's own model: its last trained adapter (the server's shared parts where it
        has never trained)."""
        return self.starting_adapter({}) if self.own else self.starting_adapter(arrays)

    def server_adapter(self, arrays: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The server's model: the global shared tensors, initial values for the rest."""
        return {**self.initial, **arrays}

    def evaluate(self, arrays: dict[str, torch.Tensor], instruction: EvaluateInstruction) -> EvaluateReply:
        c, split = self.cfg, self.node.test
        if c.vlm.eval_samples and len(split) > c.vlm.eval_samples:
            split = split.subset(np.arange(c.vlm.eval_samples), f"first{c.vlm.eval_samples}")
        metrics: dict = {NUM_EXAMPLES: len(split)}
        models = {CLIENT_MODEL: self.personal_adapter(arrays), SERVER_MODEL: self.server_adapter(arrays)}
        for tag, adapter in models.items():
            if adapter is None:
                continue
            load_adapter_state(self.vlm.model, adapter)
            scores = score_split(self.vlm, split, self.node.dataset.task, c.vlm.max_new_tokens, c.vlm.eval_batch_size)
            metrics.update({vlm_score(tag, k): v for k, v in scores.items()})
        ood, server = self.ood_shard(), models[SERVER_MODEL]
        if ood is not None and server is not None:
            # out-of-domain (NoCaps-style) scores of the server's model; every client scores one
            # shard, so the test-size-weighted mean covers the whole OOD set
            load_adapter_state(self.vlm.model, server)
            scores = score_split(self.vlm, ood, self.node.dataset.task, c.vlm.max_new_tokens, c.vlm.eval_batch_size)
            metrics.update({vlm_score(OOD, k): v for k, v in scores.items()})
            metrics[OOD_EXAMPLES] = len(ood)
        return EvaluateReply(metrics)

    def ood_shard(self):
        ood = self.node.dataset.ood
        n = int(self.node.config.get(NUM_PARTITIONS, 1) or 1)
        if ood is None or self.node.partition_id < 0:
            return None
        idx = np.arange(self.node.partition_id, len(ood), n)
        cap = self.cfg.vlm.eval_samples
        if cap and len(idx) > cap:
            idx = idx[:cap]
        return ood.subset(idx, f"ood{self.node.partition_id}of{n}") if len(idx) else None


class LoRARound(Learner):
    """One round of a LoRA method: the ``Learner`` hooks of ``client_app.trainer`` on the
    adapter's trainable tensors (per-sample gradients from Opacus on the VLM, the whole adapter
    clipped as one)."""

    def __init__(self, client: LoRAClient, params: Mapping[str, torch.Tensor], opt: torch.optim.Optimizer):
        self.client = client
        self.params = params  # the adapter's trainable tensors, by name (the model's own parameters)
        self.opt = opt
        self.started = time.time()

    @property
    def module(self) -> torch.nn.Module:  # type: ignore[override]  # read-only here; the trainer only reads it
        return self.client.vlm.model

    def begin_step(self) -> Mapping[str, torch.Tensor]:
        return self.params

    def clip_groups(self, names):
        return (tuple(names),)  # the whole adapter's per-sample gradient is clipped as one

    def forward(self, batch: np.ndarray) -> StepOutput:
        vlm, split = self.client.vlm, self.client.node.train
        if not len(batch):
            return StepOutput(torch.zeros(0, device=vlm.device))
        inputs = vlm.training_batch(
            [split.images.image(i) for i in batch], [split.prompts[i] for i in batch], [split.targets[i] for i in batch]
        )
        per_sample, token_mean = vlm.losses(inputs)
        return StepOutput(per_sample, objective=token_mean)

    def apply(self, grads: dict[str, torch.Tensor]) -> None:
        for k, p in self.params.items():
            p.grad = grads[k]
        self.opt.step()


class FedRandClient(LoRAClient):
    """Both halves train; the node keeps both (the unsent one is its private counterpart)."""

    def keep(self, trained):
        return trained

    def check_request(self, arrays, instruction):
        """FedRand's rule, checked on the node so that a server cannot collect both halves: the
        reply is one whole half (every layer's A, or every layer's B), and the server sends that
        same half, or the whole adapter on the node's first participation."""
        super().check_request(arrays, instruction)
        requested = sorted(instruction.reply_keys)
        halves = {h: adapter_parts.lora_half(self.shareable, h) for h in adapter_parts.HALVES}
        half = next((h for h, names in halves.items() if requested == names), None)
        if half is None:
            raise RequestRefused(
                f"fedrand: the server asked for {len(requested)} tensors back, not one whole LoRA half "
                "(all A or all B); the other half must stay on this node"
            )
        first = not self.own
        allowed = sorted(self.shareable) if first else halves[half]
        if sorted(arrays) != allowed:
            raise RequestRefused(
                f"fedrand: the server sent {len(arrays)} tensors with a request for half {half}; it "
                f"must send exactly that half{' or, at a first participation, both' if first else ''}"
            )


class FedParaClient(LoRAClient):
    def server_adapter(self, arrays):
        # ΔW = (w1 pair) ⊙ (w2 pair): without a client's private w2 pair the server's model is
        # the base model (w2_b starts at zero), so there is no server model to score.
        return None
