"""Client trainers of the prompt-learning family (PromptFL, local CoOp, zero-shot).

They share ``PromptClient``: the frozen backbone, the prompt encoder over all class names,
the cached image features of this node, one local training loop and one evaluation. A
method only says which context it trains, what it keeps private and what it sends.

Evaluation follows DP-FPL: accuracy on the node's own test classes ("local") and, for a
pathological split, on every other node's test classes ("neighbor"); the argmax is always
over all classes of the dataset.
"""

from __future__ import annotations

import hashlib

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fedvlm.client_app.local_training import batches, private_gradients
from fedvlm.client_app.node import NodeData
from fedvlm.client_app.publishing import publish
from fedvlm.client_app.scoring import PromptScorer, TemplateScorer
from fedvlm.client_app.state import load_meta, load_private, optimizer_tensors, restore_optimizer, save_meta, save_private
from fedvlm.models.feature_cache import encode_images
from fedvlm.models.clip_loader import load_clip
from fedvlm.models.prompt_learner import PromptEncoder, clip_logits
from fedvlm.privacy.ledger import PrivacySettings
from fedvlm.privacy.mechanisms import noise_generator, sampling_rng
from fedvlm.utils.rng import NodeStream, node_key
from fedvlm.privacy.planner import ClientShape, client_local_sigma
from fedvlm.protocol import EvaluateInstruction, HelloReport, TrainInstruction
from fedvlm.runconfig import RunConfig


@dataclass
class TrainResult:
    ctx: torch.Tensor
    loss: float
    accuracy: float
    steps: int
    examples: int


class PromptClient:
    """Shared machinery; subclasses implement ``train`` and ``personal_prompts`` (what the
    client evaluates with and, at the end of a run, publishes)."""

    scorer_class = PromptScorer

    # a prompt method's sharing rule names its tensors itself (MethodSpec.shares)
    tensor_names: tuple[str, ...] = ()

    def __init__(self, cfg: RunConfig, node: NodeData, state, server_round: int):
        self.cfg = cfg
        self.node = node
        self.state = state
        self.round = server_round
        self.bundle = load_clip(cfg["clip.model"], cfg["clip.pretrained"], cfg.cache_dir, cfg["device"])
        self.scale = self.bundle.logit_scale
        self.classnames = node.splits.classnames
        self.private = load_private(state)
        self.meta = load_meta(state)
        self.privacy = PrivacySettings.from_config(cfg)
        self.scorer = self.scorer_class(self.bundle, self.classnames, cfg)

    # --- handshake ---------------------------------------------------------------------------
    def hello(self) -> HelloReport:
        """Who this node is, for the server's handshake. Touches the features now, so that the
        first round measures training, not encoding."""
        node = self.node
        n_train = len(self.features("train")[1])
        n_test = len(self.features("test")[1])
        n_neighbor = len(node.part.neighbor) if node.part.neighbor is not None else 0
        if n_neighbor:
            self.features("neighbor")
        details = {
            "dataset": node.splits.train.identity,
            "classes": ",".join(str(c) for c in node.part.classes),
            # label i must mean the same class on every node: the server compares this digest
            "class-list": hashlib.sha256("\n".join(self.classnames).encode()).hexdigest()[:16],
            "device": str(self.bundle.device),
            "noise-source": node.noise_source,
        }
        return HelloReport(node.name, node.partition_id, n_train, n_test, n_neighbor, node.splits.n_classes,
                           self.bundle.fingerprint, details)

    # --- data ------------------------------------------------------------------------------
    def features(self, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached image features and labels of 'train', 'test' (local) or 'neighbor'.

        Training features cover this node's own images only. Evaluation features are taken
        from one cache entry for the whole test split, which every simulated node shares
        (local and neighbor sets are both slices of it)."""
        c = self.cfg
        if which == "train":
            split, idx = self.node.splits.train, self.node.part.train
            feats = self.scorer.image_features(split, idx, c.cache_dir)
        else:
            split = self.node.splits.test
            idx = self.node.part.test if which == "test" else self.node.part.neighbor
            feats = self.scorer.image_features(split, np.arange(len(split)), c.cache_dir)[idx]
        labels = torch.from_numpy(split.labels[idx])
        return feats.to(self.bundle.device), labels.to(self.bundle.device)

    def _augmented_batch(self, batch_idx: np.ndarray) -> torch.Tensor:
        split = self.node.splits.train
        return encode_images(self.bundle, split, self.node.part.train[batch_idx], len(batch_idx), transform=self.bundle.augment).to(self.bundle.device)

    def encoder(self, ctx: torch.Tensor) -> PromptEncoder:
        return self.scorer.encoder(ctx)

    def rng(self) -> np.random.Generator:
        return sampling_rng(self.node.noise_source, node_key(self.cfg["seed"], self.node.seed, NodeStream.BATCHES, self.round))

    # --- training ------------------------------------------------------------------------------
    def make_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        c = self.cfg
        if c["prompt.optimizer"] == "adam":
            return torch.optim.Adam(params, lr=c["prompt.lr"], weight_decay=c["prompt.weight-decay"])
        return torch.optim.SGD(params, lr=c["prompt.lr"], momentum=c["prompt.momentum"], weight_decay=c["prompt.weight-decay"])

    def num_steps(self, n: int) -> int:
        c = self.cfg
        if c["prompt.local-steps"] > 0:
            return c["prompt.local-steps"]
        return c["prompt.local-epochs"] * math.ceil(n / c["prompt.batch-size"])

    def local_sigma(self, instruction: TrainInstruction) -> float:
        """The std of this round's local-DP noise (0 without privacy), checked against this
        node's own plan: a missing or smaller value than the plan needs is refused."""
        n = len(self.features("train")[1])
        return client_local_sigma(self.cfg, ClientShape(n, self.cfg["prompt.batch-size"], self.num_steps(n)), instruction.local_sigma)

    def train_context(self, ctx0: torch.Tensor, anchor: torch.Tensor | None = None, mu: float = 0.0,
                      noise_std: dict[str, float] | None = None) -> TrainResult:
        """Local steps on the context: CE over all classes (+ FedProx term when mu > 0), with
        clipping and local-DP noise when privacy is on (``noise_std`` from the server's plan).

        The optimiser state (momentum / Adam moments) persists in the node's private state.
        """
        feats, labels = self.features("train")
        n = len(labels)
        if n == 0:
            raise RuntimeError(f"{self.node.name} holds no training images")
        ctx = ctx0.detach().clone().to(self.bundle.device).requires_grad_(True)
        opt = self.make_optimizer([ctx])
        restore_optimizer(opt, {k: v.to(self.bundle.device) for k, v in self.private.items()})
        encoder = self.encoder(ctx)
        gen = noise_generator(self.node.noise_source, node_key(self.cfg["seed"], self.node.seed, NodeStream.LOCAL_NOISE, self.round))
        bsz = self.cfg["prompt.batch-size"]
        losses_seen, correct, seen, steps = [], 0, 0, self.num_steps(n)
        for batch in batches(n, bsz, steps, self.privacy, self.rng()):
            x = self._augmented_batch(batch) if self.cfg["prompt.augment"] else feats[batch]
            text = encoder(ctx)
            logits = clip_logits(x, text, self.scale)
            losses = F.cross_entropy(logits, labels[batch], reduction="none")
            grads, _ = private_gradients(losses, {"ctx": ctx}, [text], self.privacy, min(bsz, n), noise_std or {}, gen)
            g = grads["ctx"]
            if mu > 0 and anchor is not None:  # FedProx: data-independent, added after privatisation
                g = g + mu * (ctx.detach() - anchor.to(ctx.device))
            opt.zero_grad(set_to_none=True)
            ctx.grad = g
            opt.step()
            if len(batch):
                losses_seen.append(float(losses.detach().mean()))
                correct += int((logits.argmax(1) == labels[batch]).sum())
                seen += len(batch)
        self.private.update({k: v.cpu() for k, v in optimizer_tensors(opt).items()})
        return TrainResult(ctx.detach().cpu(), float(np.mean(losses_seen)) if losses_seen else float("nan"),
                           correct / max(seen, 1), steps, n)

    # --- evaluation and publishing -----------------------------------------------------------
    def personal_prompts(self, arrays: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    @torch.no_grad()
    def evaluate_prompts(self, prompts: dict[str, torch.Tensor]) -> dict[str, float]:
        out: dict[str, float] = {}
        for which, tag in (("test", "local"), ("neighbor", "neighbor")):
            if which == "neighbor" and (self.node.part.neighbor is None or len(self.node.part.neighbor) == 0):
                continue
            feats, labels = self.features(which)
            if len(labels) == 0:
                continue
            logits = self.scorer.logits(prompts, feats)
            out[f"{tag}-acc"] = float((logits.argmax(1) == labels).float().mean())
            out[f"{tag}-loss"] = float(F.cross_entropy(logits, labels))
            out[f"{tag}-n"] = int(len(labels))
        out["num-examples"] = out.get("local-n", 0)
        return out

    def evaluate(self, arrays: dict[str, torch.Tensor], instruction: EvaluateInstruction) -> dict[str, float]:
        prompts = self.personal_prompts(arrays)
        save_private(self.state, self.private)  # a first contact may have initialised private parts
        publish(self, prompts, instruction)
        return self.evaluate_prompts(prompts)

    def persist(self) -> None:
        self.meta["rounds-trained"] = int(self.meta.get("rounds-trained", 0)) + 1
        save_private(self.state, self.private)
        save_meta(self.state, self.meta)

    def train_metrics(self, res: TrainResult) -> dict[str, float]:
        return {"num-examples": res.examples, "train-loss": res.loss, "train-acc": res.accuracy,
                "steps": res.steps, "rounds-trained": int(self.meta.get("rounds-trained", 0))}


class PromptFLClient(PromptClient):
    """Trains the received global prompt; sends it back for weighted averaging."""

    def train(self, arrays: dict[str, torch.Tensor], instruction: TrainInstruction):
        global_ctx = arrays["ctx"]
        noise = {"ctx": self.local_sigma(instruction)}
        res = self.train_context(global_ctx, anchor=global_ctx, mu=self.cfg["prompt.fedprox-mu"], noise_std=noise)
        self.persist()
        return {"ctx": res.ctx}, self.train_metrics(res)

    def personal_prompts(self, arrays):
        return {"ctx": arrays["ctx"]}


class CoOpClient(PromptClient):
    """Trains its own prompt and keeps it: nothing leaves the node but metrics.

    The server's initial prompt (public, data-independent) seeds the private prompt the first
    time the node is reached, so that every method starts from the same point."""

    def _own_ctx(self, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
        if "ctx" not in self.private:
            if "ctx" not in arrays:
                raise RuntimeError("first contact with this node but the server sent no initial prompt")
            self.private["ctx"] = arrays["ctx"].clone()
        return self.private["ctx"]

    def train(self, arrays, instruction):
        res = self.train_context(self._own_ctx(arrays))
        self.private["ctx"] = res.ctx
        self.persist()
        return {}, self.train_metrics(res)

    def personal_prompts(self, arrays):
        return {"ctx": self._own_ctx(arrays)}


class ZeroShotClient(PromptClient):
    """CLIP with a hand-written template: no training, nothing shared."""

    scorer_class = TemplateScorer

    def train(self, arrays, instruction):
        raise RuntimeError("zeroshot does not train; the server should not send it train messages")

    def personal_prompts(self, arrays):
        return {}
