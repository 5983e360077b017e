"""Every run-config key: its default, type, accepted values and meaning.

This table is the single source of truth: ``pyproject.toml``'s ``[tool.flwr.app.config]``
must list exactly these keys with these defaults (a test checks it), the README's key table
is checked against it, and ``methods.registry.validate`` enforces it on the server and on every
client before any work starts.

Keys are flat strings; a dot groups them (``prompt.lr`` is written ``prompt.lr = 0.01`` in
TOML and ``--run-config "prompt.lr=0.01"`` on the command line).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Key:
    name: str
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None
    min: float | None = None
    max: float | None = None
    min_exclusive: bool = False
    check: Callable[[Any], str | None] | None = None  # returns an error text, or None

    @property
    def kind(self) -> type:
        return type(self.default)


def _positive_or_auto(value: float) -> str | None:
    return None if value == -1 or value > 0 else "must be > 0, or -1 for the method family's value"


def _non_negative_or_auto(value: float) -> str | None:
    return None if value == -1 or value >= 0 else "must be >= 0, or -1 for the method family's value"


def _ratios(value: str) -> str | None:
    parts = value.split(":")
    try:
        nums = [float(p) for p in parts]
    except ValueError:
        return "must be numbers separated by ':' such as '45:9:1'"
    if len(nums) < 2 or any(n <= 0 for n in nums):
        return "needs at least two positive numbers such as '45:9:1'"
    return None


def _template(value: str) -> str | None:
    return None if value.count("{}") == 1 else "must contain exactly one '{}' where the class name goes"


KEYS: tuple[Key, ...] = (
    # --- what to run -------------------------------------------------------------------
    # Accepted methods come from the registry in ``methods``, checked by ``validate``.
    Key("method", "promptfl", "Federated method (see the README's method table)."),
    Key("num-server-rounds", 20, "Federated rounds (zeroshot evaluates once).", min=1),
    Key("seed", 0, "Seed of every random draw: partition, sampling, initialisation, noise.", min=0),
    Key("fraction-train", 0.0, "Fraction of connected clients sampled for training each round; 0 = the "
        "family's papers' value (1.0 prompt methods, 0.3 VLM methods).", min=0.0, max=1.0),
    Key("fraction-evaluate", 1.0, "Fraction of clients evaluated each round.",
        min=0.0, max=1.0, min_exclusive=True),
    Key("min-nodes", 2, "Clients that must be connected before the first round starts.", min=1),
    Key("round-timeout", 600.0, "Seconds to wait for client replies in one round.", min=1.0),
    # --- where things go -----------------------------------------------------------------
    Key("output-dir", "", "Absolute directory for run folders; empty = ~/fedvlm-runs."),
    Key("run-name", "", "Name of this run's folder; empty = <method>-<dataset>-<time>."),
    Key("cache-dir", "", "Cache for pretrained embedded models and image features; "
        "empty = $FEDVLM_CACHE or ~/.cache/fedvlm."),
    Key("device", "auto", "Client compute device.", choices=("auto", "cpu", "cuda")),
    # --- data ----------------------------------------------------------------------------
    Key("dataset", "auto", "Dataset; 'auto' = the method family's embedded default.",
        choices=("auto", "embedded", "embedded-shadow", "digits", "caltech101", "oxford-pets", "flowers102",
                 "food101", "dtd", "cifar10", "cifar100", "image-folder", "bloodmnist",
                 # the VLM methods' datasets
                 "embedded-captions", "embedded-vqa", "coco-captions", "scienceqa")),
    Key("data-root", "", "Directory holding the dataset files (torchvision layouts or an "
        "image folder <root>/<class>/*.jpg)."),
    Key("download", False, "Let torchvision download a missing dataset into data-root."),
    Key("partitioner", "auto", "How data is split over clients; 'auto' = family default.",
        choices=("auto", "pathological", "dirichlet", "iid", "quantity-skew")),
    Key("dirichlet-alpha", 0.0, "Concentration of the Dirichlet label split; 0 = the family's papers' "
        "value (0.3 prompt methods, 0.5 VLM methods).", min=0.0),
    Key("quantity-ratios", "45:9:1", "Client size ratios of the quantity-skew split "
        "(one number per client).", check=_ratios),
    Key("test-fraction", 0.3, "Test share for datasets without an official split.",
        min=0.0, max=1.0, min_exclusive=True),
    Key("max-per-class", 0, "Keep at most this many training images per class "
        "(few-shot, CoOp style); 0 = all.", min=0),
    # --- CLIP backbone -----------------------------------------------------------------------
    Key("clip.model", "embedded-tiny", "open_clip architecture (ViT-B-16, RN50, ...) or "
        "'embedded-tiny' (pretrained here on the embedded domain, offline)."),
    Key("clip.pretrained", "", "open_clip pretrained tag (openai, laion2b_s34b_b88k, ...) or a "
        "local checkpoint path; empty = random init (benchmarks only)."),
    Key("clip.image-batch-size", 128, "Batch size for computing image features.", min=1),
    # --- prompt learning -------------------------------------------------------------------
    Key("prompt.n-ctx", 16, "Number of learnable context tokens M.", min=1),
    Key("prompt.ctx-init", "", "Initialise the context from this phrase (e.g. 'a photo of a'); "
        "its token count then sets M."),
    Key("prompt.class-specific", False, "One context per class instead of one shared context."),
    Key("prompt.init-std", 0.02, "Std of the random context initialisation.", min=0.0,
        min_exclusive=True),
    Key("prompt.optimizer", "adam", "Local optimiser of the prompt (CoOp and DP-FPL on real "
        "CLIP use sgd).", choices=("sgd", "adam")),
    Key("prompt.lr", 0.01, "Local learning rate (CoOp on real CLIP: sgd with 0.002).", min=0.0,
        min_exclusive=True),
    Key("prompt.momentum", 0.9, "SGD momentum (sgd only).", min=0.0, max=1.0),
    Key("prompt.weight-decay", 0.0005, "Weight decay.", min=0.0),
    Key("prompt.batch-size", 32, "Local batch size B.", min=1),
    Key("prompt.local-epochs", 1, "Local epochs per round (used when local-steps is 0).", min=1),
    Key("prompt.local-steps", -1, "Local steps per round; 0 = local-epochs full passes; -1 = the "
        "method's default (1 for dpfpl/fedotp/fedpgp, DP-FPL's Algorithm 1, and for promptfl with "
        "privacy on, as DP-FPL's baselines; 0 otherwise).", min=-1),
    Key("prompt.augment", False, "Random crop/flip while training; re-encodes images every "
        "step instead of using the feature cache (slow)."),
    Key("prompt.fedprox-mu", 0.0, "FedProx proximal weight for promptfl (0 = plain FedAvg).",
        min=0.0),
    Key("zeroshot.template", "a photo of a {}.", "Hand-written prompt of the zeroshot method.",
        check=_template),
    # --- DP-FPL and the global/local prompt baselines ----------------------------------------
    Key("dpfpl.rank", 8, "Rank k of DP-FPL's factorisation of the local prompt (0 = full rank, no "
        "factorisation).", min=0),
    Key("dpfpl.residual", True, "Keep the residual r = p_L - u v in the forward prompt (false = "
        "the no-residual ablation)."),
    Key("dpfpl.server-optimizer", "sgd", "Server step on the noisy averaged global-prompt gradient.",
        choices=("sgd", "adam")),
    Key("dpfpl.server-lr", 0.01, "Server learning rate eta_G (paper, ViT-B/16: 1e-4 with sgd).",
        min=0.0, min_exclusive=True),
    Key("fedotp.eps", 0.1, "Entropic regularisation of FedOTP's optimal transport.", min=0.0,
        min_exclusive=True),
    Key("fedotp.tau", 1.0, "Marginal relaxation of FedOTP's unbalanced OT (KL weight; larger = "
        "closer to balanced).", min=0.0, min_exclusive=True),
    Key("fedotp.iters", 100, "Sinkhorn iterations.", min=1),
    Key("fedpgp.rank", 8, "Rank k of FedPGP's personal low-rank prompt u v.", min=1),
    Key("fedpgp.mu", 1.0, "Weight of FedPGP's prompt-wise contrastive term (0 = off).", min=0.0),
    Key("fedpgp.temperature", 0.5, "Temperature of FedPGP's contrastive term.", min=0.0, min_exclusive=True),
    # --- VLM methods (FedRand and its baselines) ---------------------------------------------------
    Key("vlm.model", "embedded-tiny-vlm", "Image-text-to-text model: a Hugging Face hub id or local directory "
        "(transformers AutoModelForImageTextToText + AutoProcessor), or 'embedded-tiny-vlm' (pretrained here, offline)."),
    Key("vlm.trust-remote-code", False, "Allow the model's own code from the hub (TinyLLaVA needs it)."),
    Key("vlm.dtype", "auto", "Weights dtype of the frozen model ('auto' = float32).",
        choices=("auto", "float32", "bfloat16", "float16")),
    Key("vlm.language-model-pattern", r"(?:language_model|text_model|llm)", "Regex naming the language model's "
        "module; LoRA goes on its layers only (vision tower and projector stay frozen)."),
    Key("vlm.max-new-tokens", 24, "Tokens generated per caption or answer at evaluation.", min=1),
    Key("vlm.eval-batch-size", 32, "Batch size of evaluation.", min=1),
    Key("vlm.eval-samples", 0, "Score at most this many test samples per client (0 = all).", min=0),
    Key("vlm.max-train", 0, "Use at most this many training samples of the dataset (0 = all).", min=0),
    Key("vlm.max-test", 0, "Use at most this many test samples of the dataset (0 = all).", min=0),
    Key("vlm.ood-captions", "", "COCO-style captions JSON of an out-of-domain set (NoCaps); its images in "
        "an 'images' folder beside it."),
    Key("vlm.hf-dataset", "derek-thomas/ScienceQA", "Hugging Face dataset id of scienceqa when data-root is empty."),
    Key("lora.rank", 8, "LoRA rank r (FedRand: 8).", min=1),
    Key("lora.alpha", 16.0, "LoRA scaling alpha (dW = alpha/r * B A).", min=0.0, min_exclusive=True),
    Key("lora.dropout", 0.05, "LoRA dropout.", min=0.0, max=1.0),
    Key("lora.target-modules", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "Comma-separated linear layer names of the language model that get LoRA."),
    Key("lora.lr", -1.0, "AdamW learning rate; -1 = 3e-4 (FedRand's value) for hub models, 3e-3 for the "
        "embedded tiny VLM."),
    Key("lora.weight-decay", 1e-6, "AdamW weight decay (FedRand: 1e-6).", min=0.0),
    Key("lora.batch-size", 8, "Local batch size (FedRand: 8).", min=1),
    Key("lora.local-epochs", 1, "Local epochs per round (FedRand: 1).", min=1),
    Key("lora.local-steps", 0, "Local steps per round; 0 = lora.local-epochs full passes.", min=0),
    Key("fedrand.rho", 0.5, "Probability that a client is sent (and returns) the A half.", min=0.0, max=1.0),
    Key("fedper.shared-layers", 2, "FedPer: number of top decoder layers whose LoRA is shared.", min=1),
    # --- Reprogrammable-FL (reprogram, bl-ff, bl-pf, bl-ts) -------------------------------------
    Key("reprogram.source-model", "auto", "Frozen source classifier: 'embedded-tiny-resnet' (pretrained "
        "here, offline), resnet18, resnet50, resnet152, resnext50_32x4d, resnext101_32x8d; 'auto' = the "
        "embedded one for the embedded/digits data, resnet50 (the paper's main model) otherwise.",
        choices=("auto", "embedded-tiny-resnet", "resnet18", "resnet50", "resnet152", "resnext50_32x4d",
                 "resnext101_32x8d")),
    Key("reprogram.source-weights", "auto", "Source weights: 'auto' (ImageNet from torchvision's cache or "
        "download; pretrained here for the embedded model), 'imagenet', 'random' (labelled NOT "
        "pretrained; tests only) or a local state-dict file."),
    Key("reprogram.image-size", -1, "Side the target image is resized to before zero-padding to the "
        "source input size (the paper: 200 of 224); -1 = 200 for torchvision models, 24 of 32 for "
        "the embedded one. The baselines resize to the full source size.", check=lambda v: None
        if v == -1 or v > 0 else "must be > 0, or -1 for the default"),
    Key("reprogram.batch-size", -1, "Expected Poisson batch size of every DP-SGD step; -1 = 256 (the "
        "paper's) on real data, 32 on the small embedded/digits data (a client holds ~400 digits).",
        check=lambda v: None if v == -1 or v > 0 else "must be > 0, or -1 for the default"),
    Key("reprogram.lr", 0.15, "SGD learning rate of DP-SGD (the paper: 0.15).", min=0.0, min_exclusive=True),
    Key("reprogram.local-iterations", 1, "DP-SGD steps per client per round, L (the paper: 1).", min=1),
    # --- privacy (every method that supports DP reads these) ---------------------------------
    Key("privacy.epsilon", 0.0, "Target epsilon per record, every mechanism its record feeds composed; "
        "0 = no noise, no clipping.",
        min=0.0),
    Key("privacy.delta", 1e-5, "Target delta.", min=0.0, max=1.0, min_exclusive=True),
    Key("privacy.clip", -1.0, "Clip norm C of every clipped gradient; -1 = the family's paper value "
        "(10, DP-FPL's, for prompt learning and LoRA; 1.0 for Reprogrammable-FL).", check=_positive_or_auto),
    Key("privacy.calibration", "accountant", "How sigma is chosen: 'accountant' (dp-accounting "
        "calibrates sigma for the target and reports epsilon spent; Poisson-sampled batches) or "
        "'paper' (DP-FPL's closed form; fixed-size batches).", choices=("accountant", "paper")),
    Key("privacy.clipping", "per-sample", "Clip each sample's gradient (per-sample, the "
        "guarantee holds) or the batch gradient (per-batch, the public code; the stated epsilon "
        "does not hold).", choices=("per-sample", "per-batch")),
    Key("privacy.accountant", "rdp", "Accountant for calibration and reporting.",
        choices=("rdp", "pld")),
    Key("privacy.noise-multiplier", -1.0, "Use this noise multiplier z = sigma/sensitivity for every "
        "mechanism instead of calibrating to privacy.epsilon (0 = calibrate); epsilon is then "
        "only reported, and privacy.max-epsilon stops the run when reached. -1 = calibrate when "
        "privacy.epsilon is set, else the family's value: 0 for prompt learning and LoRA, 1.1 for "
        "Reprogrammable-FL (its paper's DP-SGD).",
        check=_non_negative_or_auto),
    Key("privacy.max-epsilon", 0.0, "Refuse to start if the plan would exceed this epsilon, stop "
        "once it is reached; 0 = no cap.", min=0.0),
    Key("privacy.noise-source", "auto", "Randomness of DP noise and batch sampling: 'seeded' "
        "(from the run seed: repeatable, but anyone with the run config can regenerate it; "
        "simulations only), 'os' (OS entropy, secret), or 'auto' (each node: 'os' when it trains "
        "on its own data-dir or its node config says noise-source=os, else seeded; the server's "
        "noise: 'os' as soon as one node is).", choices=("auto", "seeded", "os")),
)

KEY_BY_NAME: dict[str, Key] = {k.name: k for k in KEYS}
DEFAULTS: dict[str, Any] = {k.name: k.default for k in KEYS}
