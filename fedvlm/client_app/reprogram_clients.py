"""Client trainers of Reprogrammable-FL: model reprogramming and its three baselines.

One client, ``ReprogramClient``; the methods differ only in the model they build
(``models.reprogram``): every parameter that trains is shared and averaged (DP-FedAvg), so
nothing tensor-valued is private. The node reports its own account of its records' epsilon by
Opacus' accountants (``privacy.dpsgd.NodeAccountant``), over this run's releases in its one
ledger (``client_app.privacy_floor``) and this round's.

A round on a client (Algorithm 1 of the paper): load the global trainable parameters, take L
DP-SGD steps (``reprogram.local-iterations``, sent in the server's plan), each on a
Poisson-sampled batch of expected size B (``reprogram.batch-size``): per-sample gradients of
every trainable parameter, each sample's whole gradient clipped to C (``privacy.clip``), the sum
divided by B plus Gaussian noise of the std the server planned, one SGD step
(``reprogram.lr``). The loop is ``client_app.trainer``; per-sample gradients come from Opacus'
hooks for reprogramming and partial fine-tuning, and from its ExpandedWeights mode for the two
full-network baselines (the model declares it, ``models.reprogram.FineTuneNet``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F

from fedvlm.client_app.client import Client, RequestRefused
from fedvlm.client_app.node import NodeData
from fedvlm.client_app.privacy_floor import run_history
from fedvlm.client_app.trainer import Learner, StepOutput
from fedvlm.metrics import (
    ACC,
    NODE_EPSILON_PRV,
    NODE_EPSILON_RDP,
    NUM_EXAMPLES,
    TEST_LOSS,
    TEST_N,
    TEST_SETS,
    TRAIN_SECONDS,
)
from fedvlm.models.clip_loader import resolve_device
from fedvlm.models.reprogram import initial_model, input_size, source_model, trainable_state
from fedvlm.privacy.canaries import Canaries
from fedvlm.privacy.dpsgd import NodeAccountant
from fedvlm.protocol import EvaluateInstruction, EvaluateReply, HelloReport, TrainInstruction, TrainReply
from fedvlm.runconfig import RunConfig
from fedvlm.spec import spec_of

_IMAGES: dict[tuple, torch.Tensor] = {}
CACHE_LIMIT_BYTES = 512 * 2**20  # keep a split's resized images in memory below this size


def resized(source, i: int, size: int) -> torch.Tensor:
    """Image ``i`` of ``source`` resized (bilinear) to size x size: uint8 [3, size, size]."""
    img = source.image(int(i)).convert("RGB").resize((size, size), resample=2)
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)


class ReprogramClient(Client):
    """Reprogrammable-FL and its baselines: what trains is the method's ``model_kind``."""

    node: NodeData

    def __init__(self, cfg: RunConfig, node: NodeData, state, server_round: int, canaries: Canaries | None = None):
        super().__init__(cfg, node, state, server_round, canaries)
        self.device = resolve_device(cfg.device)
        self.source = source_model(cfg)
        self.kind = spec_of(cfg).model_kind
        self.model = initial_model(cfg, self.kind, node.splits.n_classes).to(self.device)
        self.size = input_size(self.kind, self.source, cfg.reprogram.image_size)
        self.settings = cfg.privacy

    @property
    def tensor_names(self) -> frozenset[str]:
        """The model's tensors (what the method's sharing rule chooses from)."""
        return frozenset(trainable_state(self.model))

    # --- handshake -----------------------------------------------------------------------------
    def hello(self) -> HelloReport:
        n = self.node
        return HelloReport(
            n.name,
            n.partition_id,
            len(n.part.train),
            len(n.part.test),
            0,
            n.splits.n_classes,
            self.source.fingerprint,
            n.noise_source,
            dataset=n.splits.train.identity,
            classes=",".join(str(c) for c in n.part.classes),
            device=str(self.device),
            source_weights=self.source.weights,
        )

    # --- data ----------------------------------------------------------------------------------
    def images(self, split: str, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Images resized to the model's input side, in [0, 1], and their labels."""
        source = self.node.splits.train if split == "train" else self.node.splits.test
        rows = self.node.part.train if split == "train" else self.node.part.test
        picked = rows[idx]
        labels = torch.from_numpy(source.labels[picked]).to(self.device)
        key = (source.content_key, self.size)
        if key not in _IMAGES and len(source) * 3 * self.size**2 <= CACHE_LIMIT_BYTES:
            _IMAGES[key] = torch.stack([self._load(source, i) for i in range(len(source))])
        pixels = (
            _IMAGES[key][torch.from_numpy(picked)]
            if key in _IMAGES
            else torch.stack([self._load(source, int(i)) for i in picked])
        )
        return pixels.to(self.device).float().div_(255.0), labels

    def _load(self, source, i: int) -> torch.Tensor:
        return resized(source, i, self.size)

    # --- parameters ----------------------------------------------------------------------------
    def _load_global(self, arrays: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for k, v in arrays.items():
                params[k].copy_(v.to(params[k].device, params[k].dtype))

    # --- a round (client_app.client.Client.train) ----------------------------------------------
    def training_records(self) -> int:
        n = len(self.node.part.train)
        if n == 0:
            raise RequestRefused(f"{self.node.name} holds no training images")
        return n

    def begin_round(self, arrays: dict[str, torch.Tensor], instruction: TrainInstruction) -> ReprogramRound:
        started = time.time()
        self._load_global(arrays)
        params = {k: p for k, p in self.model.named_parameters() if p.requires_grad}
        opt = torch.optim.SGD(list(params.values()), lr=self.cfg.reprogram.lr)
        self.model.train()
        return ReprogramRound(self, params, opt, started)

    def finish_round(self, session, stats, shape, sigma, instruction):
        c, n = self.cfg, len(self.node.part.train)
        metrics = {**stats.metrics(n), TRAIN_SECONDS: time.time() - session.started}
        if self.settings.enabled:
            # the node's own account, by Opacus' accountants, of its ledger's releases before this
            # round (client_app.privacy_floor, the node's one ledger) and of this one: z = sigma / (C / B)
            accountant = NodeAccountant(
                [
                    (r["noise-multiplier"], r["sampling-rate"], int(r["steps"]))
                    for r in run_history(self.node, self.state, instruction.run_dir, self.round)
                ]
            )
            accountant.step(
                sigma * shape.expected_batch / c.privacy.clip, shape.sampling_rate(self.settings), shape.steps
            )
            eps = accountant.epsilon(self.settings.delta)
            metrics.update({NODE_EPSILON_RDP: eps["rdp"], NODE_EPSILON_PRV: eps["prv"]})
        shared = {k: v.detach().cpu().clone() for k, v in trainable_state(self.model).items()}
        return TrainReply(shared, metrics)

    # --- evaluation ----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, arrays: dict[str, torch.Tensor], instruction: EvaluateInstruction) -> EvaluateReply:
        self._load_global(arrays)
        self.model.eval()
        n = len(self.node.part.test)
        loss, correct, bs = 0.0, 0, 256
        for start in range(0, n, bs):
            x, y = self.images("test", np.arange(start, min(n, start + bs)))
            logits = self.model(x)
            loss += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(1) == y).sum())
        local = TEST_SETS[0]  # a reprogramming node has no neighbour classes
        figures = {ACC[local]: correct / n, TEST_LOSS[local]: loss / n} if n else {}  # no test records: no figures
        return EvaluateReply({**figures, TEST_N[local]: n, NUM_EXAMPLES: n})


class ReprogramRound(Learner):
    """One round of Reprogrammable-FL or a baseline: the ``Learner`` hooks of
    ``client_app.trainer`` on the model's trainable parameters (per-sample gradients from Opacus,
    each sample's whole gradient clipped as one)."""

    def __init__(
        self, client: ReprogramClient, params: Mapping[str, torch.Tensor], opt: torch.optim.Optimizer, started: float
    ):
        self.client = client
        self.module = self.net = client.model  # the trainer swaps in its per-sample wrapper as net
        self.params = params  # the trainable parameters, by name
        self.opt = opt
        self.started = started

    def begin_step(self) -> Mapping[str, torch.Tensor]:
        return self.params

    def clip_groups(self, names):
        return (tuple(names),)  # DP-SGD: each sample's whole gradient is clipped as one

    def forward(self, batch: np.ndarray) -> StepOutput:
        if not len(batch):
            return StepOutput(torch.zeros(0, device=self.client.device), correct=0)
        x, y = self.client.images("train", batch)
        assert self.net is not None  # the model, or the trainer's per-sample wrapper of it
        logits = self.net(x)
        return StepOutput(F.cross_entropy(logits, y, reduction="none"), correct=int((logits.argmax(1) == y).sum()))

    def apply(self, grads: dict[str, torch.Tensor]) -> None:
        for k, p in self.params.items():
            p.grad = grads[k]
        self.opt.step()
