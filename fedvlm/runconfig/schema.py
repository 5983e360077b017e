"""Every run-config key: its default, type, accepted values and meaning, as typed sections.

The dataclasses below are the single source of truth. A section is one dotted prefix
(``prompt.lr`` is ``RunConfig.prompt.lr``); a field's annotation is the key's type and its
``opt`` metadata holds the help text and the accepted range. ``KEYS`` is read from them;
``pyproject.toml``'s ``[tool.flwr.app.config]`` must list exactly these keys with these
defaults (a test checks it), docs/configuration.md's key table is generated from them, and
``methods.validation.validate`` enforces them on the server and on every client before any work
starts.

Keys are flat strings in Flower's run config (``prompt.lr = 0.01`` in TOML,
``--run-config "prompt.lr=0.01"`` on the command line); code reads them typed
(``cfg.prompt.lr``). One sentinel, ``AUTO`` (``'auto'``), means "the method or its family
decides": ``validate`` replaces it before a ``RunConfig`` exists, except where the node decides
(``device``, ``privacy.noise-source``, ``vlm.dtype``, ``reprogram.source-weights``). A number the
method decides is a ``decided`` field: 'auto' is its flat default only, and the typed field
(``int`` or ``float``, as annotated) has no default, since it always holds a resolved number.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedvlm.privacy.accountants import ACCOUNTANTS, REFERENCE
from fedvlm.runconfig.datasets import NAMES as DATASET_NAMES

AUTO = "auto"


@dataclass(frozen=True)
class Key:
    name: str  # the flat name, e.g. 'prompt.local-steps'
    section: str  # '' for the top level, else the section's attribute on RunConfig
    attr: str  # the field's attribute name, e.g. 'local_steps'
    kind: type  # bool, int, float or str
    default: Any
    help: str
    # accepted values; a registry's live dict (its keys), so a later registration is accepted
    choices: Collection[Any] | None = None
    min: float | None = None
    max: float | None = None
    min_exclusive: bool = False
    check: Callable[[Any], str | None] | None = None  # returns an error text, or None

    @property
    def auto(self) -> bool:
        """A typed key that also accepts 'auto' (the method or its family decides)."""
        return self.kind is not str and self.default == AUTO


def opt(
    default: Any,
    help: str,
    *,
    choices: Collection[Any] | None = None,
    min: float | None = None,
    max: float | None = None,
    min_exclusive: bool = False,
    check: Callable[[Any], str | None] | None = None,
) -> Any:
    """One key: its default (``AUTO`` for a number the method decides) and what is accepted."""
    return field(
        default=default,
        metadata={"key": dict(help=help, choices=choices, min=min, max=max, min_exclusive=min_exclusive, check=check)},
    )


def decided(
    help: str,
    *,
    min: float | None = None,
    max: float | None = None,
    min_exclusive: bool = False,
) -> Any:
    """A number the method or its family decides unless the run config sets it: its flat default
    is ``AUTO``, and the typed config has no default for it (``validate`` always resolves it
    before a ``RunConfig`` exists, so the field's type is the number it then holds)."""
    return field(
        kw_only=True,
        metadata={
            "key": dict(help=help, choices=None, min=min, max=max, min_exclusive=min_exclusive, check=None),
            "decided": True,
        },
    )


def _ratios(value: str) -> str | None:
    parts = value.split(":")
    try:
        nums = [float(p) for p in parts]
    except ValueError:
        return "must be numbers separated by ':' such as '45:9:1'"
    if len(nums) < 2 or not all(0 < n < math.inf for n in nums):  # also refuses nan
        return "needs at least two positive finite numbers such as '45:9:1'"
    return None


RUN_NAME = re.compile(r"^(?!\.{1,2}$)[\w.@+-]{1,100}$")


def _run_name(value: str) -> str | None:
    """A run's folder is one name inside output-dir: '../x' or '/abs' once wrote outside it, and a
    5,000-character name left no folder at all (the file system's limit is 255 bytes)."""
    if value == "" or RUN_NAME.match(value):
        return None
    return "must be one folder name of 1-100 letters, digits or ._@+- (not '.' or '..'), such as 'promptfl-seed0'"


def _pin(value: str) -> str | None:
    """A fingerprint is one word as results.json records it: a pin with a space or a line in it
    would be refused only at the server's start, against weights it can never match."""
    if value == "" or (len(value) <= 200 and not any(c.isspace() for c in value)):
        return None
    return "must be a fingerprint as results.json's run.backbone.fingerprint records it (no spaces, at most 200 chars)"


TEMPLATE_CHARS = 2000  # no text of CLIP's 77 tokens is longer; the exact check is the scorer's, per class


def _template(value: str) -> str | None:
    if len(value) > TEMPLATE_CHARS:
        return f"is {len(value)} characters: CLIP's text context (77 tokens) holds far fewer; shorten it"
    return None if value.count("{}") == 1 else "must contain exactly one '{}' where the class name goes"


def _regex(value: str) -> str | None:
    try:
        re.compile(value)
    except re.error as err:
        return f"is not a regular expression ({err}): escape what should match itself"
    return None


@dataclass(frozen=True)
class ClipConfig:
    """The CLIP backbone of the prompt methods."""

    model: str = opt(
        "embedded-tiny",
        "open_clip architecture (ViT-B-16, RN50, ...) or 'embedded-tiny' (pretrained "
        "here on the embedded domain, offline).",
    )
    pretrained: str = opt(
        "",
        "open_clip pretrained tag (openai, laion2b_s34b_b88k, ...) or a local checkpoint path; "
        "empty = random init (benchmarks only).",
    )
    image_batch_size: int = opt(128, "Batch size for computing image features.", min=1)


@dataclass(frozen=True)
class PromptConfig:
    """Prompt learning (CoOp's learnable context), shared by every prompt method."""

    n_ctx: int = opt(
        16,
        "Number of learnable context tokens M; at most 72, so that with the start, end and full-stop tokens and a "
        "two-token class name the prompt fits CLIP's 77-token text context.",
        min=1,
        max=72,
    )
    ctx_init: str = opt(
        "", "Initialise the context from this phrase (e.g. 'a photo of a'); its token count then sets M."
    )
    class_specific: bool = opt(False, "One context per class instead of one shared context.")
    init_std: float = opt(0.02, "Std of the random context initialisation.", min=0.0, min_exclusive=True)
    optimizer: str = opt(
        "adam", "Local optimiser of the prompt (CoOp and DP-FPL on real CLIP use sgd).", choices=("sgd", "adam")
    )
    lr: float = opt(0.01, "Local learning rate (CoOp on real CLIP: sgd with 0.002).", min=0.0, min_exclusive=True)
    momentum: float = opt(0.9, "SGD momentum (sgd only).", min=0.0, max=1.0)
    weight_decay: float = opt(0.0005, "Weight decay.", min=0.0)
    batch_size: int = opt(32, "Local batch size B.", min=1)
    local_epochs: int = opt(1, "Local epochs per round (used when local-steps is 0).", min=1)
    local_steps: int = decided(
        "Local steps per round; 0 = local-epochs full passes; 'auto' = the method's (1 for "
        "dpfpl/fedotp/fedpgp, DP-FPL's Algorithm 1, and for promptfl and pfedmoap with privacy on, as "
        "DP-FPL's baselines: their private runs then train fewer steps than their runs without noise, "
        "which the leaderboard's -dpcompute rows match; 0 otherwise).",
        min=0,
    )
    augment: bool = opt(
        False,
        "Random crop/flip while training; re-encodes images every step instead of using the feature cache (slow).",
    )
    fedprox_mu: float = opt(0.0, "FedProx proximal weight for promptfl (0 = plain FedAvg).", min=0.0)


@dataclass(frozen=True)
class ZeroShotConfig:
    template: str = opt("a photo of a {}.", "Hand-written prompt of the zeroshot method.", check=_template)


@dataclass(frozen=True)
class DPFPLConfig:
    """DP-FPL's global + factorised local prompt."""

    rank: int = opt(8, "Rank k of DP-FPL's factorisation of the local prompt (0 = full rank, no factorisation).", min=0)
    residual: bool = opt(
        True, "Keep the residual r = p_L - u v in the forward prompt (false = the no-residual ablation)."
    )
    server_optimizer: str = opt(
        "sgd", "Server step on the noisy averaged global-prompt gradient.", choices=("sgd", "adam")
    )
    server_lr: float = opt(
        0.01, "Server learning rate eta_G (paper, ViT-B/16: 1e-4 with sgd).", min=0.0, min_exclusive=True
    )
    global_update: str = opt(
        "server",
        "How the global prompt learns. server: DP-FPL's, the client returns the mean gradient of the global prompt "
        "it received and the server steps it. local: FedOTP's and FedPGP's own FedAvg, the client steps the global "
        "prompt with its local optimiser every local step and returns start minus end, which the server averages "
        "(server-lr 1 with sgd: their mean); without privacy only.",
        choices=("server", "local"),
    )


@dataclass(frozen=True)
class FedOTPConfig:
    eps: float = opt(0.1, "Entropic regularisation of FedOTP's optimal transport.", min=0.0, min_exclusive=True)
    tau: float = opt(
        1.0,
        "Marginal relaxation of FedOTP's unbalanced OT (KL weight; larger = closer to balanced).",
        min=0.0,
        min_exclusive=True,
    )
    iters: int = opt(100, "Sinkhorn iterations.", min=1)


@dataclass(frozen=True)
class FedPGPConfig:
    rank: int = opt(8, "Rank k of FedPGP's personal low-rank prompt u v.", min=1)
    mu: float = opt(1.0, "Weight of FedPGP's prompt-wise contrastive term (0 = off).", min=0.0)
    temperature: float = opt(0.5, "Temperature of FedPGP's contrastive term.", min=0.0, min_exclusive=True)


@dataclass(frozen=True)
class PFedMoAPConfig:
    """pFedMoAP's mixture of prompt experts and its private attention gate."""

    k: int = opt(
        9,
        "Expert prompts each node receives: its K nearest other prompts in the server's pool (all of "
        "them when the pool holds fewer); 0 = no experts (plain CoOp logits).",
        min=0,
    )
    selection: str = opt(
        "knn",
        "How the server picks the experts: 'knn' (L2 distance between prompt tensors, ties "
        "by node name) or 'random' (a seeded draw per node and round).",
        choices=("knn", "random"),
    )
    lambda_: float = opt(0.5, "Weight of the local prompt's own CLIP logits beside the mixture's.", min=0.0)
    gating_dim: int = opt(
        128, "Width of the gate (the CLIP features are subsampled to it; must divide the embedding dimension).", min=1
    )
    gating_heads: int = opt(8, "Attention heads of the gate (must divide gating-dim).", min=1)
    attention_scale: float = opt(
        10.0, "Scale of the gate's attention logits (the public code's 10, not 1/sqrt(d)).", min=0.0, min_exclusive=True
    )
    gating_lr: float = opt(
        0.01,
        "Learning rate of the gate (momentum and weight decay: prompt.momentum, prompt.weight-decay).",
        min=0.0,
        min_exclusive=True,
    )
    gating_optimizer: str = opt("sgd", "Optimiser of the gate; its state stays on the node.", choices=("sgd", "adam"))
    dp_placement: str = opt(
        "step",
        "Where privacy.epsilon's noise goes: 'step' (DP-SGD on the prompt and the gate "
        "at every local step; covers everything the node releases) or 'upload' (the prompt "
        "update clipped and noised once per round; does not cover the node's own "
        "personalised model).",
        choices=("step", "upload"),
    )


@dataclass(frozen=True)
class VLMConfig:
    """The image-text-to-text model of FedRand and its baselines."""

    model: str = opt(
        "embedded-tiny-vlm",
        "Image-text-to-text model: a Hugging Face hub id or local directory "
        "(transformers AutoModelForImageTextToText + AutoProcessor), or 'embedded-tiny-vlm' (pretrained "
        "here, offline).",
    )
    trust_remote_code: bool = opt(False, "Allow the model's own code from the hub (TinyLLaVA needs it).")
    dtype: str = opt(
        AUTO, "Weights dtype of the frozen model ('auto' = float32).", choices=(AUTO, "float32", "bfloat16", "float16")
    )
    language_model_pattern: str = opt(
        r"(?:language_model|text_model|llm)",
        "Regex naming the language model's "
        "module; LoRA goes on its layers only (vision tower and projector stay frozen).",
        check=_regex,
    )
    max_new_tokens: int = opt(24, "Tokens generated per caption or answer at evaluation.", min=1)
    eval_batch_size: int = opt(32, "Batch size of evaluation.", min=1)
    eval_samples: int = opt(0, "Score at most this many test samples per client (0 = all).", min=0)
    max_train: int = opt(0, "Use at most this many training samples of the dataset (0 = all).", min=0)
    max_test: int = opt(0, "Use at most this many test samples of the dataset (0 = all).", min=0)
    ood_captions: str = opt(
        "", "COCO-style captions JSON of an out-of-domain set (NoCaps); its images in an 'images' folder beside it."
    )
    hf_dataset: str = opt("derek-thomas/ScienceQA", "Hugging Face dataset id of scienceqa when data-root is empty.")


@dataclass(frozen=True)
class LoRAConfig:
    rank: int = opt(8, "LoRA rank r (FedRand: 8).", min=1)
    alpha: float = opt(16.0, "LoRA scaling alpha (dW = alpha/r * B A).", min=0.0, min_exclusive=True)
    dropout: float = opt(0.05, "LoRA dropout.", min=0.0, max=1.0)
    target_modules: str = opt(
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "Comma-separated linear layer names of the language model that get LoRA.",
    )
    lr: float = decided(
        "AdamW learning rate; 'auto' = 3e-4 (FedRand's value) for hub models, 3e-3 for the embedded tiny VLM.",
        min=0.0,
        min_exclusive=True,
    )
    weight_decay: float = opt(1e-6, "AdamW weight decay (FedRand: 1e-6).", min=0.0)
    batch_size: int = opt(8, "Local batch size (FedRand: 8).", min=1)
    local_epochs: int = opt(1, "Local epochs per round (FedRand: 1).", min=1)
    local_steps: int = opt(0, "Local steps per round; 0 = lora.local-epochs full passes.", min=0)


@dataclass(frozen=True)
class FedRandConfig:
    rho: float = opt(0.5, "Probability that a client is sent (and returns) the A half.", min=0.0, max=1.0)


@dataclass(frozen=True)
class FedPerConfig:
    shared_layers: int = opt(2, "FedPer: number of top decoder layers whose LoRA is shared.", min=1)


@dataclass(frozen=True)
class ReprogramConfig:
    """Reprogrammable-FL (reprogram, bl-ff, bl-pf, bl-ts)."""

    source_model: str = opt(
        AUTO,
        "Frozen source classifier: 'embedded-motif-resnet' (pretrained here on 240 motif classes, "
        "offline; '-ls': with label smoothing 0.1), 'embedded-tiny-resnet' (pretrained here on 40 "
        "shape classes), resnet18, resnet50, "
        "resnet152, resnext50_32x4d, resnext101_32x8d; 'auto' = the motif one for the motifs task, "
        "the tiny one for the other embedded data and digits, resnet50 (the paper's main model) otherwise.",
        choices=(
            AUTO,
            "embedded-motif-resnet",
            "embedded-motif-resnet-ls",
            "embedded-tiny-resnet",
            "resnet18",
            "resnet50",
            "resnet152",
            "resnext50_32x4d",
            "resnext101_32x8d",
        ),
    )
    source_weights: str = opt(
        AUTO,
        "Source weights: 'auto' (ImageNet from torchvision's cache or download; "
        "pretrained here for the embedded model), 'imagenet', 'random' (labelled NOT "
        "pretrained; tests only) or a local state-dict file.",
    )
    image_size: int = decided(
        "Side the target image is resized to before zero-padding to the source input size "
        "(the paper: 200 of 224); 'auto' = 200 for torchvision models, 24 of 32 for the embedded "
        "ones. The baselines resize to the full source size.",
        min=1,
    )
    batch_size: int = decided(
        "Expected Poisson batch size of every DP-SGD step; 'auto' = 256 (the paper's) on "
        "real data, 32 on the small embedded data (a client holds ~670 motifs or ~400 digits).",
        min=1,
    )
    lr: float = opt(0.15, "SGD learning rate of DP-SGD (the paper: 0.15).", min=0.0, min_exclusive=True)
    local_iterations: int = opt(1, "DP-SGD steps per client per round, L (the paper: 1).", min=1)


@dataclass(frozen=True)
class PrivacyConfig:
    """Differential privacy; every method that supports DP reads these."""

    epsilon: float = opt(
        0.0,
        "Target epsilon per record, every mechanism its record feeds composed; 0 = no noise, no clipping. At most "
        "100: past it an (epsilon, delta) bound says nothing about a record.",
        min=0.0,
        max=100.0,
    )
    delta: float = opt(
        1e-5,
        "Target delta; once the nodes are known it must be at most 0.1 / (the federation's training records).",
        min=0.0,
        min_exclusive=True,
        check=lambda d: None if d <= 0.1 else "must be at most 0.1 (and, once the nodes are known, 0.1/records)",
    )
    clip: float = decided(
        "Clip norm C of every clipped gradient; 'auto' = the family's paper value (10, "
        "DP-FPL's, for prompt learning and LoRA; 1.0 for Reprogrammable-FL).",
        min=0.0,
        min_exclusive=True,
    )
    calibration: str = opt(
        "accountant",
        "How sigma is chosen: 'accountant' (dp-accounting calibrates sigma for the "
        "target and reports epsilon spent; Poisson-sampled batches) or 'paper' (DP-FPL's closed "
        "form; fixed-size batches).",
        choices=("accountant", "paper"),
    )
    clipping: str = opt(
        "per-sample",
        "Clip each sample's gradient (per-sample, the guarantee holds) or the batch "
        "gradient (per-batch, the public code; the stated epsilon does not hold).",
        choices=("per-sample", "per-batch"),
    )
    accountant: str = opt(
        REFERENCE, "Accountant for calibration and reporting (privacy.accountants' registry).", choices=ACCOUNTANTS
    )
    noise_multiplier: float = decided(
        "Use this noise multiplier z = sigma/sensitivity for every mechanism instead "
        "of calibrating to privacy.epsilon (0 = calibrate); epsilon is then only reported, "
        "and privacy.max-epsilon stops the run when reached. 'auto' = calibrate when "
        "privacy.epsilon is set, else the family's value: 0 for prompt learning and LoRA, "
        "1.1 for Reprogrammable-FL (its paper's DP-SGD).",
        min=0.0,
    )
    max_epsilon: float = opt(
        0.0, "Refuse to start if the plan would exceed this epsilon, stop once it is reached; 0 = no cap.", min=0.0
    )
    noise_source: str = opt(
        AUTO,
        "Randomness of DP noise and batch sampling: 'seeded' (from the run seed: "
        "repeatable, but anyone with the run config can regenerate it; simulations only), 'os' "
        "(OS entropy, secret), or 'auto' (each node: what its node config's noise-source says, else "
        "seeded only when it is simulated on a partition and states no max-epsilon of its own, else "
        "os; the server's noise: 'os' as soon as one node is). 'seeded' never overrides a node.",
        choices=(AUTO, "seeded", "os"),
    )
    audit_canaries: int = opt(
        0,
        "One-run privacy audit: m canary records inserted into the audited node's training data, each "
        "present with probability 1/2 (OS entropy); results.json's 'audit' section then holds the epsilon "
        "lower bound they give beside the accounted epsilon. 0 = no audit (no canaries anywhere). At most "
        "100,000 (the audit is within 5% of the truth there; each canary holds a gradient-sized record).",
        min=0,
        max=100_000,
    )
    audit_node: int = opt(0, "Partition id of the node that carries the audit's canaries.", min=0)

    @property
    def enabled(self) -> bool:
        """Privacy is on: noise calibrated to an epsilon, or a fixed noise multiplier."""
        return self.epsilon > 0 or self.noise_multiplier > 0

    @property
    def fixed_noise(self) -> bool:
        """A fixed noise multiplier: no calibration, epsilon only reported (a budget-limited run)."""
        return self.noise_multiplier > 0

    @property
    def sampling(self) -> str:
        """Record sampling of local steps: Poisson (what the accountant assumes) unless the
        paper's calibration is used, which goes with fixed-size uniform minibatches (its code)."""
        return "uniform" if self.calibration == "paper" and not self.fixed_noise else "poisson"


@dataclass(frozen=True)
class RepliesConfig:
    """What the server accepts from a client (``strategies.validation``). An update is what a
    reply changes: the returned tensors minus what the node was sent (a returned gradient, which
    was not sent, as it is)."""

    norm_ratio: float = opt(
        10.0,
        "Bound on a client's update norm, as a multiple of the round's median update norm (the lower "
        "median, so one honest and one hostile reply cannot set it); 0 = no relative bound.",
        min=0.0,
    )
    max_norm: float = opt(0.0, "Absolute bound on a client's update norm (L2, all its tensors); 0 = none.", min=0.0)
    norm_action: str = opt(
        "clip",
        "What happens to an update past a bound: clip (scaled to the bound, recorded) or reject (dropped, recorded).",
        choices=("clip", "reject"),
    )


@dataclass(frozen=True)
class SecureAggregationConfig:
    """Secure aggregation (``fedvlm.secagg``: SecAgg+, Bell et al. 2020): the server learns only the
    sum of each round's surviving clients' updates; a method with server-side noise has every
    client add its share of it instead (the distributed discrete Gaussian, ``privacy.distributed``).
    docs/privacy.md says what it protects against and what it costs."""

    enabled: bool = opt(False, "Aggregate every round securely: the server never sees one client's update.")
    bits: int = opt(
        32,
        "The sum is computed modulo 2^bits (each coordinate travels in 4 bytes up to 32 bits, else 8); with "
        "distributed noise the server refuses a plan whose sum could wrap around with probability above 1e-9.",
        min=16,
        max=62,
    )
    neighbours: int = opt(
        0,
        "How many others each client shares its secrets with: 0 = every other client of the round (SecAgg); "
        "an even k >= 2 = SecAgg+'s random graph of degree k (cost grows with k, not with the round's size).",
        min=0,
    )
    threshold: int = opt(
        0,
        "How many of a client's share holders rebuild its secrets (the most clients that may collude with the "
        "server is one less): 0 = the smallest strict majority; never less than that.",
        min=0,
    )
    rounding_overhead: float = opt(
        0.05,
        "With distributed noise: how much rounding to integers may add to a record's sensitivity (a fraction); "
        "smaller costs more bits, larger more noise.",
        min=0.0,
        max=1.0,
        min_exclusive=True,
    )
    prekeys: bool = opt(
        True,
        "Key a round with the keys each client sent with its previous train reply, where every client of the "
        "round has sent some: the clients deal their shares with the training, four exchanges a round instead of "
        "five (docs/privacy.md, 'Keys made a round ahead'); false = every round's keys are made in it.",
    )
    roster: str = opt(
        "",
        "The federation's member roster (roster.json from python -m fedvlm.deploy.credentials), as a path on the "
        "ServerApp's host: the server relays only keys its members signed, and every node checks them against the "
        "roster it pins; empty = a simulation's roster, built from its nodes.",
    )


@dataclass(frozen=True)
class TrackingConfig:
    """Experiment trackers (``server_app.tracking``): each round's figures, the ledger's epsilon,
    bytes and seconds, the validated config, and at the end the run folder's files. Off by
    default; they need ``pip install 'fedvlm[tracking]'``; a tracker that fails costs a warning
    (recorded in results.json's ``run.tracking``), never the run. They change nothing computed,
    so a resumed run may change them."""

    tensorboard: bool = opt(
        False,
        "Write each round's figures, epsilon, bytes and seconds as TensorBoard event files in the run "
        "folder's tensorboard/.",
    )
    mlflow: bool = opt(
        False,
        "Log the run to MLflow: the config as parameters, each round's figures as metrics, results.json, rounds.csv, "
        "the plots and the ledger as artifacts at the end.",
    )
    mlflow_uri: str = opt(
        "",
        "MLflow tracking URI (such as http://127.0.0.1:5000); empty = $MLFLOW_TRACKING_URI, else a SQLite store "
        "in output-dir (mlflow.db, artifacts in mlartifacts/).",
    )
    experiment: str = opt("fedvlm", "MLflow experiment the run is logged in (made if missing).")


@dataclass(frozen=True)
class AttackConfig:
    """Membership-attack experiments: online LiRA's reference federations (``python -m fedvlm.attacks
    --online R`` sets these, an ordinary run leaves them alone) and the server's record of uploads."""

    reference: int = opt(
        -1,
        "Train as online-LiRA reference federation j: each simulated node trains on its training "
        "records outside the membership candidates plus a seeded half of the candidates (members and "
        "non-members pooled; data/membership.py). -1 = an ordinary run.",
        min=-1,
    )
    candidate_seed: int = opt(
        0, "Seed that draws each client's membership candidates (the attack command's --seed).", min=0
    )
    observe_uploads: bool = opt(
        False,
        "Honest-but-curious server: write what every client uploads in every round, with what it was sent, "
        "to the run folder's uploads/ (the server's attack in python -m fedvlm.attacks reads them). Off: nothing "
        "kept beyond the aggregate.",
    )


@dataclass(frozen=True)
class RunConfig:
    """The validated, resolved, read-only run config (``methods.validation.validate`` makes it).

    Top-level keys are fields here; dotted keys live in their section (``cfg.privacy.clip``).
    ``spec`` is the method's registry entry, attached by ``validate``.
    """

    # --- what to run ------------------------------------------------------------------------
    # Accepted methods come from the registry in ``methods``, checked by ``validate``.
    method: str = opt("promptfl", "Federated method (see the README's method table).")
    num_server_rounds: int = opt(20, "Federated rounds (zeroshot evaluates once).", min=1, max=100_000)
    seed: int = opt(0, "Seed of every random draw: partition, sampling, initialisation, noise.", min=0)
    fraction_train: float = decided(
        "Fraction of connected clients sampled for training each round; 'auto' = the "
        "family's papers' value (1.0 prompt methods, 0.3 VLM methods).",
        min=0.0,
        max=1.0,
        min_exclusive=True,
    )
    fraction_evaluate: float = opt(
        1.0, "Fraction of clients evaluated each round.", min=0.0, max=1.0, min_exclusive=True
    )
    evaluate_every: int = opt(
        1,
        "Evaluate every k-th round and always the last (1 = every round). The rounds between record "
        "training's figures only, and a headline's 'mean of the last 10' is over the last 10 evaluations.",
        min=1,
    )
    min_nodes: int = opt(2, "Clients that must be connected before the first round starts.", min=1)
    round_timeout: float = opt(600.0, "Seconds to wait for client replies in one round.", min=1.0)
    reply_grace: float = opt(
        10.0,
        "Seconds a missing reply may still take once no other reply of its phase is arriving (or twice "
        "the slowest reply time seen, if longer); then it is asked again once, and after as long again "
        "the round goes on without it. 0 = wait round-timeout for every reply.",
        min=0.0,
    )
    # --- where things go --------------------------------------------------------------------
    output_dir: str = opt("", "Absolute directory for run folders; empty = ~/fedvlm-runs.")
    run_name: str = opt("", "Name of this run's folder; empty = <method>-<dataset>-<time>.", check=_run_name)
    resume: str = opt(
        "",
        "Run folder of an interrupted run: continue it from its last completed round, with the same config "
        "(num-server-rounds may grow). Empty = a new run.",
    )
    cache_dir: str = opt(
        "",
        "Cache for pretrained embedded models and image features of the ServerApp and simulated nodes; empty = "
        "$FEDVLM_CACHE or ~/.cache/fedvlm. A deployed node caches where its node config says.",
    )
    device: str = opt(
        AUTO, "Client compute device ('auto' = cuda where the node has it).", choices=(AUTO, "cpu", "cuda")
    )
    backbone_fingerprint: str = opt(
        "",
        "The backbone weights the run must start from: results.json's run.backbone.fingerprint, whole or its "
        "16 hex digits. A server that loads other weights refuses the run before round 1 (every node must match "
        "the server). Empty = whatever the server loads.",
        check=_pin,
    )
    # --- data --------------------------------------------------------------------------------
    dataset: str = opt(
        AUTO,
        "Dataset; 'auto' = the method family's embedded default.",
        choices=(AUTO, *DATASET_NAMES),  # the catalogue's order: image classification, then the VLM methods'
    )
    data_root: str = opt(
        "",
        "Directory holding the dataset files (torchvision layouts or an image folder <root>/<class>/*.jpg); "
        "simulation only: a deployed node reads its node config's data-dir or data-root.",
    )
    download: bool = opt(False, "Let torchvision download a missing dataset into data-root.")
    partitioner: str = opt(
        AUTO,
        "How data is split over clients; 'auto' = family default.",
        choices=(AUTO, "pathological", "dirichlet", "iid", "quantity-skew"),
    )
    dirichlet_alpha: float = decided(
        "Concentration of the Dirichlet label split; 'auto' = the family's papers' "
        "value (0.3 prompt methods, 0.5 VLM methods).",
        min=0.0,
        min_exclusive=True,
    )
    class_split: str = opt(
        "none",
        "'base-to-novel': train on the first half of the classes and test also on the other half, each scored "
        "among its own classes (CoCoOp's protocol; the prompt methods). 'none': every class.",
        choices=("none", "base-to-novel"),
    )
    quantity_ratios: str = opt(
        "45:9:1", "Client size ratios of the quantity-skew split (one number per client).", check=_ratios
    )
    test_fraction: float = opt(
        0.3, "Test share for datasets without an official split.", min=0.0, max=1.0, min_exclusive=True
    )
    max_per_class: int = opt(
        0, "Keep at most this many training images per class (few-shot, CoOp style); 0 = all.", min=0
    )
    embedded_per_class: int = opt(
        64,
        "Training images per class of the embedded image dataset and its shadow (test: 3/8 as many); raise "
        "it to give many clients data (640: about 26 each for 1,000 clients).",
        min=8,
    )
    # --- sections ------------------------------------------------------------------------------
    clip: ClipConfig = field(kw_only=True)
    prompt: PromptConfig = field(kw_only=True)
    zeroshot: ZeroShotConfig = field(kw_only=True)
    dpfpl: DPFPLConfig = field(kw_only=True)
    fedotp: FedOTPConfig = field(kw_only=True)
    fedpgp: FedPGPConfig = field(kw_only=True)
    pfedmoap: PFedMoAPConfig = field(kw_only=True)
    vlm: VLMConfig = field(kw_only=True)
    lora: LoRAConfig = field(kw_only=True)
    fedrand: FedRandConfig = field(kw_only=True)
    fedper: FedPerConfig = field(kw_only=True)
    reprogram: ReprogramConfig = field(kw_only=True)
    privacy: PrivacyConfig = field(kw_only=True)
    attack: AttackConfig = field(kw_only=True)
    replies: RepliesConfig = field(kw_only=True)
    secure_aggregation: SecureAggregationConfig = field(kw_only=True)
    tracking: TrackingConfig = field(kw_only=True)
    # the method's registry entry, a ``spec.MethodSpec``. The config sits below the spec (the layer
    # map, tests/unit/test_layers.py), so it cannot name that type and holds it opaque: as
    # ``object`` no caller reads a field of it unchecked; ``spec.spec_of`` is the one typed door
    spec: object = field(kw_only=True, compare=False, repr=False)

    @classmethod
    def from_flat(cls, values: dict[str, Any], spec: object) -> RunConfig:
        """The typed config of resolved flat values; a numeric key still 'auto' is a registry bug."""
        unresolved = [k.name for k in KEYS if k.auto and values[k.name] == AUTO]
        if unresolved:
            raise AssertionError(f"the registry left {unresolved} at 'auto'; its family or method must resolve them")
        sections: dict[str, dict[str, Any]] = {"": {}}
        for k in KEYS:
            sections.setdefault(k.section, {})[k.attr] = values[k.name]
        top = sections.pop("")
        return cls(**top, **{s: _SECTIONS[s](**fields) for s, fields in sections.items()}, spec=spec)

    def as_dict(self) -> dict[str, Any]:
        """The flat run config (Flower's form): what results.json records and simulations send."""
        return {k.name: getattr(getattr(self, k.section) if k.section else self, k.attr) for k in KEYS}

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir)


_KINDS: dict[str, type] = {"bool": bool, "int": int, "float": float, "str": str}


def _keys() -> tuple[tuple[Key, ...], dict[str, type]]:
    """Every key, read from the dataclasses (annotations are strings under ``__future__``)."""
    keys: list[Key] = []
    sections: dict[str, type] = {}

    def add(cls: Any, section: str) -> None:
        for f in dataclasses.fields(cls):
            if "key" in f.metadata:
                name = f.name.rstrip("_").replace("_", "-")  # 'lambda_' (a Python keyword) is 'lambda'
                prefix = section.replace("_", "-")  # secure_aggregation's keys are secure-aggregation.*
                keys.append(
                    Key(
                        f"{prefix}.{name}" if section else name,
                        section,
                        f.name,
                        _KINDS[str(f.type)],
                        AUTO if f.metadata.get("decided") else f.default,
                        **f.metadata["key"],
                    )
                )
            elif str(f.type).endswith("Config"):
                sections[f.name] = globals()[str(f.type)]
                add(sections[f.name], f.name)

    add(RunConfig, "")
    return tuple(keys), sections


KEYS, _SECTIONS = _keys()
KEY_BY_NAME: dict[str, Key] = {k.name: k for k in KEYS}
DEFAULTS: dict[str, Any] = {k.name: k.default for k in KEYS}
