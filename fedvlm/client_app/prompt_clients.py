"""Client trainers of the prompt-learning family (PromptFL, local CoOp, zero-shot).

They share ``PromptClient``: the frozen backbone, the prompt encoder over all class names,
the cached image features of this node, the training hooks of one context (the loop itself is
``client_app.trainer``) and one evaluation. A method only says which context it trains, what it
keeps private and what it sends.

Evaluation follows DP-FPL: accuracy on the node's own test classes ("local") and, for a
pathological split, on every other node's test classes ("neighbor"); the argmax is over all
classes of the dataset. Under ``class-split = base-to-novel`` (CoCoOp's protocol) the node also
scores its share of the novel classes' test records ("novel"), and each set is scored among its
own classes only: base among the base classes, novel among the novel ones.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from fedvlm.client_app.client import Client, RequestRefused
from fedvlm.client_app.node import NodeData
from fedvlm.client_app.scoring import PromptScorer, TemplateScorer
from fedvlm.client_app.server_view import UploadView
from fedvlm.client_app.state import optimizer_tensors, restore_optimizer
from fedvlm.client_app.trainer import Learner, RoundStats, StepOutput
from fedvlm.metrics import ACC, NUM_EXAMPLES, ROUNDS_TRAINED, TEST_LOSS, TEST_N, TEST_SETS
from fedvlm.models.clip_loader import load_clip
from fedvlm.models.feature_cache import encode_images
from fedvlm.models.prompt_learner import PromptEncoder, clip_logits
from fedvlm.privacy.canaries import Canaries
from fedvlm.privacy.dpsgd import DPStep, privatize_batch
from fedvlm.protocol import EvaluateInstruction, EvaluateReply, HelloReport, TrainInstruction, TrainReply
from fedvlm.runconfig import RunConfig
from fedvlm.runconfig.schema import PrivacyConfig
from fedvlm.spec import spec_of
from fedvlm.tensor_names import CTX
from fedvlm.utils.runtime import simulated

# the partition's record sets each test set of ``metrics.TEST_SETS`` is scored on
EVALUATED = ("test", "neighbor", "novel")


class PromptClient(Client):
    """Shared machinery; subclasses implement ``personal_prompts`` (what the client evaluates
    with and, at the end of a run, publishes) and, where it differs from sending the trained
    context, ``finish_round``. A round here trains one context (``PromptRound``: PromptFL, CoOp);
    the global/local methods and pFedMoAP start their own sessions."""

    scorer_class = PromptScorer

    # the prompt's optimiser state (momentum, Adam moments) carries over to the next round
    keeps_prompt_optimizer = True

    node: NodeData

    def __init__(self, cfg: RunConfig, node: NodeData, state, server_round: int, canaries: Canaries | None = None):
        super().__init__(cfg, node, state, server_round, canaries)
        self.bundle = load_clip(cfg.clip.model, cfg.clip.pretrained, cfg.cache_path, cfg.device)
        self.scale = self.bundle.logit_scale
        self.classnames = node.splits.classnames
        self.privacy = cfg.privacy
        self.scorer = self.scorer_class(self.bundle, self.classnames, cfg)

    @staticmethod
    def server_view(
        sent: dict[str, torch.Tensor], uploaded: dict[str, torch.Tensor], known: dict[str, torch.Tensor]
    ) -> UploadView:
        """How the server reads this round's upload (attacks.server), given what it sent and what
        the client uploaded before (``known``). The methods that upload their trained prompt
        (PromptFL, pFedMoAP): its change from the prompt sent is the round's descent."""
        return UploadView({CTX: sent[CTX]}, {CTX: uploaded[CTX] - sent[CTX]})

    # --- handshake ---------------------------------------------------------------------------
    def hello(self) -> HelloReport:
        """Who this node is, for the server's handshake. A real node encodes its images now, so
        that an unreadable one fails the handshake and the first round measures training, not
        encoding. A simulated node leaves it to its first round: the server greets every node of
        the federation before round 1, and encoding them all, one after another on one machine,
        would cost in proportion to the nodes that exist (minutes for a thousand), not to the
        ones a round samples (docs/results/speed.md, 'Scale')."""
        node = self.node
        n_train, n_test = len(node.part.train), len(node.part.test)
        n_neighbor = len(node.part.neighbor) if node.part.neighbor is not None else 0
        n_novel = len(node.part.novel) if node.part.novel is not None else 0
        if not simulated():
            for which in ("train", "test", *(w for w, n in (("neighbor", n_neighbor), ("novel", n_novel)) if n)):
                self.features(which)
        return HelloReport(
            node.name,
            node.partition_id,
            n_train,
            n_test,
            n_neighbor,
            node.splits.n_classes,
            self.bundle.fingerprint,
            node.noise_source,
            dataset=node.splits.train.identity,
            classes=",".join(str(c) for c in node.part.classes),
            device=str(self.bundle.device),
            # label i must mean the same class on every node: the server compares this digest
            class_list=hashlib.sha256("\n".join(self.classnames).encode()).hexdigest()[:16],
            num_novel=n_novel,
        )

    # --- data ------------------------------------------------------------------------------
    def features(self, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached image features and labels of 'train', 'test' (local), 'neighbor' or 'novel'.

        Training features cover this node's own images only. Evaluation features are taken
        from one cache entry for the whole test split, which every simulated node shares
        (local and neighbor sets are both slices of it)."""
        c = self.cfg
        if which == "train":
            split, idx = self.node.splits.train, self.node.part.train
            feats = self.scorer.image_features(split, idx, c.cache_dir)
        else:
            split = self.node.splits.test
            chosen = getattr(self.node.part, which)
            assert chosen is not None  # callers ask for 'neighbor' or 'novel' only where the partition has one
            idx = chosen
            feats = self.scorer.image_features(split, np.arange(len(split)), c.cache_dir)[idx]
        labels = torch.from_numpy(split.labels[idx])
        return feats.to(self.bundle.device), labels.to(self.bundle.device)

    def _augmented_batch(self, batch_idx: np.ndarray) -> torch.Tensor:
        split = self.node.splits.train
        return encode_images(
            self.bundle, split, self.node.part.train[batch_idx], len(batch_idx), transform=self.bundle.augment
        ).to(self.bundle.device)

    def encoder(self, ctx: torch.Tensor) -> PromptEncoder:
        return self.scorer.encoder(ctx)

    # --- a round (client_app.client.Client.train) ----------------------------------------------
    def make_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        c = self.cfg
        if c.prompt.optimizer == "adam":
            return torch.optim.Adam(params, lr=c.prompt.lr, weight_decay=c.prompt.weight_decay)
        return torch.optim.SGD(params, lr=c.prompt.lr, momentum=c.prompt.momentum, weight_decay=c.prompt.weight_decay)

    def training_records(self) -> int:
        if len(self.node.part.train) == 0:
            raise RequestRefused(f"{self.node.name} holds no training images")
        return len(self.node.part.train)

    def start_context(self, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
        """The context this round trains from (default: the one the server sent)."""
        return arrays[CTX]

    def begin_round(self, arrays: dict[str, torch.Tensor], instruction: TrainInstruction) -> Learner:
        return self.prompt_round(arrays)

    def prompt_round(self, arrays: dict[str, torch.Tensor]) -> PromptRound:
        """A round on one context: CE over all classes, trained from ``start_context``; the
        optimiser state (momentum, Adam moments) carries over in the node's private state where
        the method keeps it."""
        feats, labels = self.features("train")
        start = self.start_context(arrays)
        ctx = start.detach().clone().to(self.bundle.device).requires_grad_(True)
        opt = self.make_optimizer([ctx])
        if self.keeps_prompt_optimizer:
            restore_optimizer(opt, {k: v.to(self.bundle.device) for k, v in self.own.items()})
        return PromptRound(self, start, ctx, opt, self.encoder(ctx), feats, labels)

    def finish_round(self, session, stats, shape, sigma, instruction) -> TrainReply:
        """A prompt method sends its trained context (noised once first where its mechanism
        says so, ``release``)."""
        ctx = self.release(session.start, self.trained_context(session), sigma)
        return TrainReply({CTX: ctx}, self.train_metrics(stats, session))

    def trained_context(self, session: PromptRound) -> torch.Tensor:
        """The round's trained context; the optimiser state kept for the next round."""
        if self.keeps_prompt_optimizer:
            self.own.update({k: v.cpu() for k, v in optimizer_tensors(session.opt).items()})
        return session.ctx.detach().cpu()

    def noised_once(self) -> bool:
        """Whether the method's local mechanism is placed on the round's whole update rather than
        on every step (``LocalDP.per_participation``, e.g. pFedMoAP's ``dp-placement='upload'``)."""
        local = spec_of(self.cfg).local_dp
        return self.privacy.enabled and local is not None and local(self.cfg).per_participation

    def step_privacy(self) -> PrivacyConfig:
        """The privacy of each local step: none where the mechanism noises the update once (the
        steps then train on raw records, and ``release`` noises what leaves)."""
        if self.noised_once():
            return replace(self.privacy, epsilon=0.0, noise_multiplier=0.0)
        return self.privacy

    def release(self, sent: torch.Tensor, trained: torch.Tensor, sigma: float) -> torch.Tensor:
        """The context that leaves the node, trained from ``sent``: as trained, or, where the
        mechanism noises the update once, ``sent`` + (the update clipped to C) + N(0, sigma^2),
        with ``sigma`` the std the node's own plan needs for one release a round (``client_plan``)."""
        if not self.noised_once():
            return trained
        step = DPStep(self.privacy.clip, 1, sigma, ((CTX,),), frozenset({CTX}))
        noised, _ = privatize_batch({CTX: trained - sent}, step, self.noise())
        return sent + noised[CTX]

    def batch_features(self, batch: np.ndarray, feats: torch.Tensor) -> torch.Tensor:
        """A batch's image features: freshly augmented and encoded, or the cached ``feats`` rows."""
        return self._augmented_batch(batch) if self.cfg.prompt.augment else feats[batch]

    def train_metrics(self, stats: RoundStats, session: PromptRound) -> dict[str, float]:
        return {**stats.metrics(len(session.labels)), ROUNDS_TRAINED: int(self.meta.get(ROUNDS_TRAINED, 0))}

    # --- evaluation and publishing -----------------------------------------------------------
    def personal_prompts(self, arrays: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    @torch.no_grad()
    def evaluate_prompts(self, prompts: dict[str, torch.Tensor]) -> dict[str, float]:
        part, sets = self.node.part, {}
        for tag, which in zip(TEST_SETS, EVALUATED, strict=True):
            if getattr(part, which) is None or len(getattr(part, which)) == 0:
                continue
            feats, labels = self.features(which)
            sets[tag] = (feats, labels, part.label_space(which))
        local = TEST_SETS[0]
        out: dict[str, float] = {NUM_EXAMPLES: len(sets[local][1]) if local in sets else 0}
        if not sets:
            return out
        # One scoring pass over every set: the prompts' text features are encoded once.
        logits = self.scorer.logits(prompts, torch.cat([f for f, _, _ in sets.values()]))
        chunks = logits.split([len(y) for _, y, _ in sets.values()])
        for (tag, (_, labels, space)), chunk in zip(sets.items(), chunks, strict=True):
            chunk, labels = chunk[:, space], labels - (space.start or 0)  # among the set's own classes
            out[ACC[tag]] = float((chunk.argmax(1) == labels).float().mean())
            out[TEST_LOSS[tag]] = float(F.cross_entropy(chunk, labels))
            out[TEST_N[tag]] = int(len(labels))
        return out

    def evaluate(self, arrays: dict[str, torch.Tensor], instruction: EvaluateInstruction) -> EvaluateReply:
        # a first contact may initialise private parts in ``own``: the handler commits them
        return EvaluateReply(self.evaluate_prompts(self.personal_prompts(arrays)))

    def published(self, arrays: dict[str, torch.Tensor]) -> dict | None:
        """The node's personal prompts (what it evaluates with), with what a user of the file
        needs to score with them: the class list and the backbone."""
        prompts = self.personal_prompts(arrays)
        if not prompts:
            return None
        return {
            "method": self.cfg.method,
            "node": self.node.name,
            "partition_id": self.node.partition_id,
            "round": self.round,
            "prompts": {k: v.detach().cpu() for k, v in prompts.items()},
            "classnames": list(self.classnames),
            "backbone": self.bundle.fingerprint,
        }


class PromptRound(Learner):
    """One round of training one context (PromptFL, CoOp; pFedMoAP's round without experts):
    the ``Learner`` hooks of ``client_app.trainer`` on what the round holds."""

    def __init__(
        self,
        client: PromptClient,
        start: torch.Tensor,
        ctx: torch.Tensor,
        opt: torch.optim.Optimizer,
        encoder: PromptEncoder,
        feats: torch.Tensor,
        labels: torch.Tensor,
        anchor: torch.Tensor | None = None,
        mu: float = 0.0,
    ):
        self.client = client
        self.start = start  # [M, d] the context the round started from, as received or kept
        self.ctx = ctx  # [M, d] the context being trained (a leaf)
        self.opt = opt
        self.encoder = encoder  # ctx -> the class text features [C, D]
        self.feats, self.labels = feats, labels  # [n, D] the node's cached training features; [n]
        self.anchor, self.mu = anchor, mu  # FedProx's anchor (the prompt received) and weight

    def begin_step(self) -> dict[str, torch.Tensor]:
        return {CTX: self.ctx}

    def forward(self, batch: np.ndarray) -> StepOutput:
        text = self.encoder(self.ctx)  # [C, D]
        logits = clip_logits(self.client.batch_features(batch, self.feats), text, self.client.scale)  # [b, C]
        y = self.labels[batch]
        return StepOutput(
            F.cross_entropy(logits, y, reduction="none"), [text], correct=int((logits.argmax(1) == y).sum())
        )

    def extra_gradients(self) -> dict[str, torch.Tensor]:
        if self.mu > 0 and self.anchor is not None:  # FedProx's proximal term
            return {CTX: self.mu * (self.ctx.detach() - self.anchor.to(self.ctx.device))}
        return {}

    def apply(self, grads: dict[str, torch.Tensor]) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.ctx.grad = grads[CTX]
        self.opt.step()


class PromptFLClient(PromptClient):
    """Trains the received global prompt; sends it back for weighted averaging."""

    def begin_round(self, arrays, instruction):
        session = self.prompt_round(arrays)
        session.anchor, session.mu = arrays[CTX], self.cfg.prompt.fedprox_mu  # FedProx, where mu > 0
        return session

    def personal_prompts(self, arrays):
        return {CTX: arrays[CTX]}


class CoOpClient(PromptClient):
    """Trains its own prompt and keeps it: nothing leaves the node but metrics.

    The server's initial prompt (public, data-independent) seeds the private prompt the first
    time the node is reached, so that every method starts from the same point."""

    def _own_ctx(self, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
        if CTX not in self.own:
            if CTX not in arrays:
                raise RequestRefused("first contact with this node but the server sent no initial prompt")
            self.own[CTX] = arrays[CTX].clone()
        return self.own[CTX]

    def start_context(self, arrays):
        return self._own_ctx(arrays)

    def finish_round(self, session, stats, shape, sigma, instruction):
        self.own[CTX] = self.trained_context(session)
        return TrainReply({}, self.train_metrics(stats, session))

    def personal_prompts(self, arrays):
        return {CTX: self._own_ctx(arrays)}


class ZeroShotClient(PromptClient):
    """CLIP with a hand-written template: no training, nothing shared."""

    scorer_class = TemplateScorer

    def training_records(self):
        raise RequestRefused("zeroshot does not train; the server should not send it train messages")

    def personal_prompts(self, arrays):
        return {}
