"""Client trainers of Reprogrammable-FL: model reprogramming and its three baselines.

One trainer, ``ReprogramClient``; the methods differ only in the model they build
(``models.reprogram``): every parameter that trains is shared and averaged (DP-FedAvg), so
nothing tensor-valued is private, but the node's privacy accountant is: it lives in the node's
state across rounds and is never restarted.

A round on a client (Algorithm 1 of the paper): load the global trainable parameters, take L
DP-SGD steps (``reprogram.local-iterations``) with Opacus, each on a Poisson-sampled batch of
expected size B (``reprogram.batch-size``): per-sample gradients of every trainable parameter,
each sample's whole gradient clipped to C (``privacy.clip``), Gaussian noise of std z*C on the
sum (z sent by the server from its privacy plan), divided by B, one SGD step (``reprogram.lr``).
Per-sample gradients come from Opacus' hooks for reprogramming and partial fine-tuning, and
from its ExpandedWeights mode for the two full-network baselines (torchvision's residual
blocks add in place, which backward hooks cannot follow).
"""

from __future__ import annotations

import json
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from fedvlm.client_app.local_training import batches
from fedvlm.client_app.node import NodeData
from fedvlm.client_app.state import load_meta, save_meta
from fedvlm.models.clip_loader import resolve_device
from fedvlm.models.reprogram import initial_model, input_size, source_model, trainable_state
from fedvlm.privacy.accounting import MEANINGLESS_EPSILON
from fedvlm.privacy.ledger import PrivacySettings
from fedvlm.privacy.mechanisms import gaussian_noise, noise_generator, sampling_rng
from fedvlm.utils.rng import NodeStream, node_key
from fedvlm.privacy.planner import ClientShape, client_local_sigma
from fedvlm.protocol import EvaluateInstruction, HelloReport, TrainInstruction
from fedvlm.runconfig import RunConfig

_IMAGES: dict[tuple, torch.Tensor] = {}
CACHE_LIMIT_BYTES = 512 * 2**20  # keep a split's resized images in memory below this size


class Accountants:
    """This node's DP-SGD history and what Opacus' RDP and PRV accountants say it has spent.
    The history (noise multiplier, sampling rate, steps) is kept in the node's state, so the
    figure covers every round this node took part in."""

    def __init__(self, meta: dict):
        self.history = [tuple(h) for h in json.loads(str(meta.get("dp-history", "[]")))]

    def step(self, noise_multiplier: float, sample_rate: float, steps: int) -> None:
        if self.history and self.history[-1][:2] == (noise_multiplier, sample_rate):
            self.history[-1] = (noise_multiplier, sample_rate, self.history[-1][2] + steps)
        else:
            self.history.append((noise_multiplier, sample_rate, steps))

    def epsilon(self, delta: float) -> dict[str, float]:
        from opacus.accountants import PRVAccountant, RDPAccountant

        if not self.history:
            return {"rdp": 0.0, "prv": 0.0}
        rdp = RDPAccountant()
        rdp.history = list(self.history)
        out = {"rdp": float(rdp.get_epsilon(delta))}
        # The PRV accountant discretises the privacy-loss distribution over a domain that grows
        # with epsilon: at vanishing noise it would exhaust memory for a figure that only says
        # "no privacy". Past MEANINGLESS_EPSILON the RDP bound (valid, looser) stands in for it.
        if out["rdp"] <= MEANINGLESS_EPSILON:
            prv = PRVAccountant()
            prv.history = list(self.history)
            out["prv"] = float(prv.get_epsilon(delta))
        else:
            out["prv"] = out["rdp"]
        return out

    def save(self, meta: dict) -> None:
        meta["dp-history"] = json.dumps(self.history)


class ReprogramClient:
    """Reprogrammable-FL and its baselines: what trains is the method's ``model_kind``."""

    def __init__(self, cfg: RunConfig, node: NodeData, state, server_round: int):
        self.cfg, self.node, self.state, self.round = cfg, node, state, server_round
        self.device = resolve_device(cfg["device"])
        self.source = source_model(cfg)
        self.kind = cfg.method.model_kind
        self.model = initial_model(cfg, node.splits.n_classes).to(self.device)
        self.size = input_size(self.kind, self.source, cfg["reprogram.image-size"])
        self.settings = PrivacySettings.from_config(cfg)
        self.meta = load_meta(state)
        self.private: dict[str, torch.Tensor] = {}  # nothing tensor-valued is private here

    @property
    def tensor_names(self) -> frozenset[str]:
        """The model's tensors (what the method's sharing rule chooses from)."""
        return frozenset(trainable_state(self.model))

    # --- handshake -----------------------------------------------------------------------------
    def hello(self) -> HelloReport:
        n = self.node
        details = {"source-weights": self.source.weights, "dataset": n.splits.train.identity,
                   "device": str(self.device), "noise-source": n.noise_source,
                   "classes": ",".join(str(c) for c in n.part.classes)}
        return HelloReport(n.name, n.partition_id, len(n.part.train), len(n.part.test), 0, n.splits.n_classes,
                           self.source.fingerprint, details)

    # --- data ----------------------------------------------------------------------------------
    def _images(self, split: str, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Images resized to the model's input side, in [0, 1], and their labels."""
        source = self.node.splits.train if split == "train" else self.node.splits.test
        rows = self.node.part.train if split == "train" else self.node.part.test
        picked = rows[idx]
        labels = torch.from_numpy(source.labels[picked]).to(self.device)
        key = (source.identity, self.size)
        if key not in _IMAGES and len(source) * 3 * self.size ** 2 <= CACHE_LIMIT_BYTES:
            _IMAGES[key] = torch.stack([self._load(source, i) for i in range(len(source))])
        pixels = _IMAGES[key][torch.from_numpy(picked)] if key in _IMAGES else \
            torch.stack([self._load(source, int(i)) for i in picked])
        return pixels.to(self.device).float().div_(255.0), labels

    def _load(self, source, i: int) -> torch.Tensor:
        img = source.image(int(i)).convert("RGB").resize((self.size, self.size), resample=2)  # bilinear
        return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)

    # --- parameters ----------------------------------------------------------------------------
    def _load_global(self, arrays: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for k, v in arrays.items():
                params[k].copy_(v.to(params[k].device, params[k].dtype))

    # --- training ------------------------------------------------------------------------------
    def train(self, arrays: dict[str, torch.Tensor], instruction: TrainInstruction) -> tuple[dict, dict]:
        t0 = time.time()
        c = self.cfg
        self._load_global(arrays)
        n = len(self.node.part.train)
        if n == 0:
            raise RuntimeError(f"{self.node.name} holds no training images")
        steps = c["reprogram.local-iterations"]
        rng = sampling_rng(self.node.noise_source, node_key(c["seed"], self.node.seed, NodeStream.BATCHES, self.round))
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=c["reprogram.lr"])
        model = self.model
        dp = self.settings.enabled
        expected = min(c["reprogram.batch-size"], n)
        if dp:
            sigma = client_local_sigma(c, ClientShape(n, c["reprogram.batch-size"], steps), instruction.local_sigma)
            z = sigma * expected / c["privacy.clip"]  # Opacus: std z*C on the sum, divided by B
            model, opt = self._make_private(opt, z, expected)
        model.train()
        losses, correct, seen = [], 0, 0
        for idx in batches(n, c["reprogram.batch-size"], steps, self.settings, rng):
            opt.zero_grad(set_to_none=True)
            if len(idx) == 0:  # an empty Poisson batch: the step is noise alone
                for p in params:
                    p.grad_sample = torch.zeros((0, *p.shape), device=p.device, dtype=p.dtype)
                opt.step()
                continue
            x, y = self._images("train", idx)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            with warnings.catch_warnings():
                # Opacus' hooks on the input program: the images need no gradient, which torch
                # reports for every backward pass; the per-sample gradients are unaffected.
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                loss.backward()
            opt.step()
            losses.append(loss.item())
            correct += int((logits.argmax(1) == y).sum())
            seen += len(idx)
        metrics = {"num-examples": n, "train-loss": float(np.mean(losses)) if losses else float("nan"),
                   "train-acc": correct / seen if seen else float("nan"), "local-steps": steps,
                   "train-seconds": time.time() - t0}
        if dp:
            acc = Accountants(self.meta)
            acc.step(z, expected / n if n > expected else 1.0, steps)
            acc.save(self.meta)
            save_meta(self.state, self.meta)
            eps = acc.epsilon(self.settings.delta)
            metrics.update({"epsilon-rdp": eps["rdp"], "epsilon-prv": eps["prv"]})
            model.zero_grad(set_to_none=True)
        shared = {k: v.detach().cpu().clone() for k, v in trainable_state(self.model).items()}
        return shared, metrics

    def _make_private(self, opt: torch.optim.Optimizer, z: float, expected_batch: int):
        """Opacus' per-sample gradients and DP optimiser around this round's model and SGD."""
        from opacus.grad_sample import GradSampleModule, GradSampleModuleExpandedWeights
        from opacus.optimizers import DPOptimizer
        from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

        full_network = self.kind in ("ff", "ts")
        wrapper = GradSampleModuleExpandedWeights if full_network else GradSampleModule
        model = wrapper(self.model, batch_first=True, loss_reduction="mean")
        gen = noise_generator(self.node.noise_source, node_key(self.cfg["seed"], self.node.seed, NodeStream.LOCAL_NOISE, self.round))

        class NoiseFromSource(DPOptimizer):
            """Opacus' optimiser drawing its noise from this node's noise source (seeded, or the
            OS's secure generator), on the CPU so that seeded runs repeat on any device."""

            def add_noise(self):
                for p in self.params:
                    _check_processed_flag(p.summed_grad)  # never noise the same sum twice
                    noise = gaussian_noise(p.summed_grad.shape, self.noise_multiplier * self.max_grad_norm, gen,
                                           p.summed_grad.device).to(p.summed_grad.dtype)
                    p.grad = (p.summed_grad + noise).view_as(p)
                    _mark_as_processed(p.summed_grad)

        dp_opt = NoiseFromSource(opt, noise_multiplier=z, max_grad_norm=self.cfg["privacy.clip"],
                                 expected_batch_size=expected_batch, loss_reduction="mean")
        return model, dp_opt

    # --- evaluation ----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, arrays: dict[str, torch.Tensor], instruction: EvaluateInstruction) -> dict:
        self._load_global(arrays)
        self.model.eval()
        n = len(self.node.part.test)
        loss, correct, bs = 0.0, 0, 256
        for start in range(0, n, bs):
            x, y = self._images("test", np.arange(start, min(n, start + bs)))
            logits = self.model(x)
            loss += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(1) == y).sum())
        acc = correct / n if n else float("nan")
        return {"local-acc": acc, "local-loss": loss / n if n else float("nan"), "local-n": n, "num-examples": n}
