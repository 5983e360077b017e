"""The method registry: every method, once, with everything that makes it that method.

Adding a method means one entry here plus, where its behaviour is new, one strategy class and
one client hooks class (``docs/adding-a-method.md``); no other module dispatches on method or
family names. ``methods.validation.validate`` turns Flower's flat run config into a checked
``RunConfig`` with the family's and the method's defaults and checks from this table.

An entry names its strategy and client classes (and a family its data loader) by path,
``'module:name'``; each side imports only what it runs (``spec.MethodSpec.strategy``,
``.client``). So this table sits below both: every node validates its run config with it
without importing any server code, and the server imports a client class only where it needs
one (the attacks' view of an upload). ``tests/unit/test_registry.py`` resolves every path.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from fedvlm.metrics import register_metric
from fedvlm.models import adapter_parts
from fedvlm.privacy.planner import ClientShape, GlobalDP, LocalDP
from fedvlm.runconfig import (
    ConfigError,
    RunConfig,
    check_reprogram,
)
from fedvlm.runconfig.schema import LoRAConfig, PromptConfig
from fedvlm.spec import Family, MethodSpec, shares_all, shares_only
from fedvlm.tensor_names import CTX, GLOBAL_GRAD


def _dp(name: str, where: str, tensors: int = 1, noises_upload: bool = True) -> Callable[[RunConfig], LocalDP]:
    return lambda cfg: LocalDP(name, where, tensors, noises_upload=noises_upload)


def _dpfpl_local(cfg: RunConfig) -> LocalDP:
    if cfg.dpfpl.rank:
        return LocalDP(
            "ldp-lowrank",
            "client: gradients of u and v (the local prompt's rank-k factors) at every local step",
            2,
            noises_upload=False,
        )
    return LocalDP(
        "ldp-local", "client: gradient of the full-rank local prompt at every local step", noises_upload=False
    )


def _pfedmoap_local(cfg: RunConfig) -> LocalDP:
    if cfg.pfedmoap.dp_placement == "upload":
        return LocalDP(
            "ldp-upload",
            "client: the prompt's update of the round, clipped to C as a whole, once per round the node trains",
            per_participation=True,
            note="covers the prompt the node uploads (seen by the server and by every other node that picks it as an "
            "expert, up to all of them), NOT "
            "the node's own personalised model: its gate and its prompt before the noise are trained on raw records",
        )
    return LocalDP(
        "ldp-prompt-gate",
        "client: per-sample-clipped gradients of the prompt and of the attention gate at every local step",
        2,
        note="the gate is noised too: the prompt's gradients pass through it, so a gate trained on raw records "
        "would carry their influence into every later upload, and it is part of the published personalised model",
    )


def _global_gradient_dp(cfg: RunConfig, per_round: int) -> GlobalDP:
    """DP-FPL's server mechanism (and its baselines'): Gaussian noise on the average of the
    sampled clients' clipped global-prompt gradients, divided by at least ``per_round``. The
    ledger's note says who sees the un-noised gradients: the server, as in the paper, or, under
    secure aggregation, no one (the server learns the noised sum)."""
    seen = (
        "secure aggregation: the server sees no client's gradient, only the survivors' sum, which carries every "
        "survivor's share of the noise"
        if cfg.secure_aggregation.enabled
        else "trusted server (as in DP-FPL): it sees each client's un-noised global-prompt gradient"
    )
    return GlobalDP(
        "gdp-global",
        f"server: average of the sampled clients' clipped global-prompt gradients (divided by at least {per_round}), "
        "once per round",
        denominator=per_round,
        tensors=(GLOBAL_GRAD,),
        note=f"{seen}. A record's batch "
        "feeds its client's local release and its share of the global release, so the per-record epsilon "
        "(records, spent, rounds[].changed) composes both; it bounds what the published global prompt and the "
        "client's published personalised prompt together reveal of a record",
    )


def _shared_context_check(cfg: RunConfig) -> None:
    """The global/local methods average one shared context's gradient (``strategies.global_local``).
    A global prompt stepped on the node (``dpfpl.global-update = local``) runs without privacy only:
    the server's noise is planned for the mean of clipped gradients of the prompt it sent, and a
    prompt stepped locally has no bound that plan covers (DP fails closed)."""
    if cfg.prompt.class_specific:
        raise ConfigError(
            f"run config 'method' = {cfg.method!r} needs a shared context: set prompt.class-specific=false"
        )
    if cfg.dpfpl.global_update == "local" and cfg.privacy.epsilon > 0:
        raise ConfigError(
            "run config dpfpl.global-update='local' (the global prompt stepped on the node) has no privacy "
            "accounting: the server's noise is planned for the mean gradient of the prompt it sent. Set "
            "dpfpl.global-update='server' for a private run, or privacy.epsilon=0"
        )


def _otp_check(cfg: RunConfig) -> None:
    _shared_context_check(cfg)
    _patch_tokens_check(cfg)


def _patch_tokens_check(cfg: RunConfig) -> None:
    """FedOTP matches every image's patch embeddings to the prompts: open_clip's own ViT and
    ResNet image towers and the embedded tiny CLIP's give them (``models.patch_tokens``); a timm
    tower does not."""
    name = cfg.clip.model
    if name == "embedded-tiny":
        return
    import open_clip

    timm = (open_clip.get_model_config(name) or {}).get("vision_cfg", {}).get("timm_model_name")
    if timm:
        raise ConfigError(
            f"run config 'method' = {cfg.method!r} matches image patches to prompts, but clip.model = "
            f"{name!r} has a timm image tower ({timm}) whose patch embeddings this project does not take: use a "
            "ViT or ResNet CLIP (e.g. ViT-B-16, RN50) or embedded-tiny"
        )


def _pfedmoap_check(cfg: RunConfig) -> None:
    dim, heads = cfg.pfedmoap.gating_dim, cfg.pfedmoap.gating_heads
    if dim % heads:
        raise ConfigError(
            f"run config 'pfedmoap.gating-dim' = {dim} is not divisible by 'pfedmoap.gating-heads' = {heads}; "
            "pick a number of heads that divides it"
        )
    if cfg.privacy.enabled and cfg.pfedmoap.dp_placement == "upload" and cfg.privacy.calibration == "paper":
        raise ConfigError(
            "run config 'pfedmoap.dp-placement' = 'upload' noises each round's update once; DP-FPL's closed-form "
            "calibration ('privacy.calibration' = 'paper') is for per-step noise: set privacy.calibration='accountant'"
        )


def _fedper_top(cfg: RunConfig, names) -> frozenset[str]:
    return frozenset(adapter_parts.top_layers(names, cfg.fedper.shared_layers))


def _fedpara_global(cfg: RunConfig, names) -> frozenset[str]:
    return frozenset(adapter_parts.loha_global(names))


def _steps_or_epochs(
    section: Callable[[RunConfig], PromptConfig | LoRAConfig],
) -> Callable[[RunConfig, int], ClientShape]:
    """The section's ``local_steps`` steps per round, or (0) ``local_epochs`` passes over the
    node's records in batches of ``batch_size``."""

    def shape(cfg: RunConfig, n_train: int) -> ClientShape:
        local = section(cfg)
        steps = local.local_steps or local.local_epochs * math.ceil(n_train / local.batch_size)
        return ClientShape(n_train, local.batch_size, steps)

    return shape


def _reprogram_shape(cfg: RunConfig, n_train: int) -> ClientShape:
    return ClientShape(n_train, cfg.reprogram.batch_size, cfg.reprogram.local_iterations)


PROMPT = Family(
    "prompt",
    False,
    "embedded",
    "pathological",
    0.3,
    1.0,
    "fedvlm.client_app.node:node_data",
    _steps_or_epochs(lambda cfg: cfg.prompt),
    class_splits=("none", "base-to-novel"),
    membership_attack="fedvlm.attacks.run:pooled_attacks",
    attack_report="fedvlm.attacks.reports:read_prompt",
)
VLM = Family(
    "vlm",
    True,
    "embedded-captions",
    "dirichlet",
    0.5,
    0.3,
    "fedvlm.client_app.vlm_node:vlm_node_data",
    _steps_or_epochs(lambda cfg: cfg.lora),
    membership_attack="fedvlm.attacks.maxrenyi:pooled_attacks",
    attack_report="fedvlm.attacks.reports:read_maxrenyi",
)
# Reprogrammable-FL: 3 clients, IID, all of them every round, DP-SGD with C = 1, z = 1.1
REPROGRAM = Family(
    "reprogram",
    False,
    "motifs",
    "iid",
    0.5,
    1.0,
    "fedvlm.client_app.node:node_data",
    _reprogram_shape,
    privacy_clip=1.0,
    noise_multiplier=1.1,
    check=check_reprogram,
    membership_attack="fedvlm.attacks.global_model:pooled_attacks",
    attack_report="fedvlm.attacks.reports:read_global",
)
FAMILIES: dict[str, Family] = {f.name: f for f in (PROMPT, VLM, REPROGRAM)}

# DP-SGD on the whole adapter (one per-sample clip over all its tensors), so whatever part a
# LoRA method sends is post-processing of noised steps
_LORA_DP = _dp(
    "ldp-adapter",
    "client: per-sample-clipped gradient of the whole adapter at every local step "
    "(DP-SGD); the tensors sent are post-processing",
)
_GLOBAL_GRAD = shares_only(GLOBAL_GRAD)
_ONE_STEP = {"prompt.local-steps": 1}  # DP-FPL's Algorithm 1: one local step per round
_REPROGRAM_DP = _dp(
    "dp-sgd",
    "client: DP-SGD (Opacus) on every trainable parameter: each sample's whole gradient "
    "clipped to C, Gaussian noise on the sum of a Poisson batch, divided by its expected size",
)


def _reprogram(name: str, kind: str, summary: str) -> MethodSpec:
    return MethodSpec(
        name,
        REPROGRAM,
        summary,
        "fedvlm.strategies.reprogram:ReprogramStrategy",
        "fedvlm.client_app.reprogram_clients:ReprogramClient",
        shares=shares_all,
        local_dp=_REPROGRAM_DP,
        model_kind=kind,
    )


METHODS: dict[str, MethodSpec] = {}


def register_method(spec: MethodSpec) -> MethodSpec:
    """Add a method: its entry, and the figures it reports beyond the catalogue's (``MethodSpec.metrics``).
    A name registered twice is refused."""
    if spec.name in METHODS:
        raise ValueError(f"a method named {spec.name!r} is already registered")
    for metric in spec.metrics:
        register_metric(metric)
    METHODS[spec.name] = spec
    return spec


for _spec in (
    MethodSpec(
        "promptfl",
        PROMPT,
        "PromptFL: one shared prompt, FedAvg weighted by client data size (optional FedProx).",
        "fedvlm.strategies.prompt:PromptFLStrategy",
        "fedvlm.client_app.prompt_clients:PromptFLClient",
        shares=shares_only(CTX),
        dp_defaults=_ONE_STEP,  # DP-FPL's baselines under DP: one local step per round (Algorithm 1)
        local_dp=_dp(
            "ldp-prompt",
            "client: gradient of the prompt at every local step (the shared prompt is post-processing)",
        ),
    ),
    MethodSpec(
        "coop",
        PROMPT,
        "CoOp trained locally: every client learns its own prompt; nothing is aggregated.",
        "fedvlm.strategies.prompt:LocalOnlyStrategy",
        "fedvlm.client_app.prompt_clients:CoOpClient",
    ),
    MethodSpec(
        "zeroshot",
        PROMPT,
        "Zero-shot CLIP with a hand-written template; evaluation only.",
        "fedvlm.strategies.prompt:EvaluateOnlyStrategy",
        "fedvlm.client_app.prompt_clients:ZeroShotClient",
        trains=False,
    ),
    MethodSpec(
        "dpfpl",
        PROMPT,
        "DP-FPL: global prompt (server, global DP) + private local prompt factorised every step "
        "into u v + residual (local DP on the gradients of u and v).",
        "fedvlm.strategies.global_local:GlobalGradientStrategy",
        "fedvlm.client_app.global_local_clients:DPFPLClient",
        shares=_GLOBAL_GRAD,
        defaults=_ONE_STEP,
        local_dp=_dpfpl_local,
        global_dp=_global_gradient_dp,
        rank_key="dpfpl.rank",
        check=_shared_context_check,
    ),
    MethodSpec(
        "fedotp",
        PROMPT,
        "FedOTP: global + local prompt per class, matched to image patches by unbalanced optimal "
        "transport; global DP on the global prompt, local DP on the local prompt.",
        "fedvlm.strategies.global_local:GlobalGradientStrategy",
        "fedvlm.client_app.global_local_clients:FedOTPClient",
        shares=_GLOBAL_GRAD,
        defaults=_ONE_STEP,
        local_dp=_dp(
            "ldp-local", "client: gradient of the full-rank local prompt at every local step", noises_upload=False
        ),
        global_dp=_global_gradient_dp,
        check=_otp_check,
    ),
    MethodSpec(
        "fedpgp",
        PROMPT,
        "FedPGP: global prompt + low-rank personal u v (factorised once) with a prompt-wise "
        "contrastive term; global DP on the global prompt, local DP on u and v.",
        "fedvlm.strategies.global_local:GlobalGradientStrategy",
        "fedvlm.client_app.global_local_clients:FedPGPClient",
        shares=_GLOBAL_GRAD,
        defaults=_ONE_STEP,
        local_dp=_dp(
            "ldp-lowrank",
            "client: gradients of the low-rank personal factors u and v at every local step",
            2,
            noises_upload=False,
        ),
        global_dp=_global_gradient_dp,
        rank_key="fedpgp.rank",
        check=_shared_context_check,
    ),
    MethodSpec(
        "pfedmoap",
        PROMPT,
        "pFedMoAP: each node mixes its prompt with its K nearest other nodes' prompts (experts, from the "
        "server's pool) through a private attention gate; FedAvg of the prompts.",
        "fedvlm.strategies.pfedmoap:PFedMoAPStrategy",
        "fedvlm.client_app.pfedmoap_clients:PFedMoAPClient",
        shares=shares_only(CTX),
        dp_defaults=_ONE_STEP,  # under DP, one local step per round like the other prompt baselines
        local_dp=_pfedmoap_local,
        check=_pfedmoap_check,
        individual_uploads="its server hands each client other clients' prompts as experts (the pool of uploads)",
    ),
    MethodSpec(
        "fedrand",
        VLM,
        "FedRand: LoRA on the VLM's language model; each round the server sends every sampled client "
        "one randomly drawn half (all A or all B), the other half stays private; per-half averaging.",
        "fedvlm.strategies.lora:FedRandStrategy",
        "fedvlm.client_app.lora_clients:FedRandClient",
        shares=shares_all,
        local_dp=_LORA_DP,
        adapter="lora",
    ),
    MethodSpec(
        "fedavg-lora",
        VLM,
        "FedAvg on the full LoRA adapter (both halves both ways): FedRand's oracle baseline.",
        "fedvlm.strategies.lora:LoRAStrategy",
        "fedvlm.client_app.lora_clients:LoRAClient",
        shares=shares_all,
        local_dp=_LORA_DP,
        adapter="lora",
    ),
    MethodSpec(
        "fedper-lora",
        VLM,
        "FedPer: the top layers' LoRA is shared (fedper.shared-layers), the rest stays on the client.",
        "fedvlm.strategies.lora:LoRAStrategy",
        "fedvlm.client_app.lora_clients:LoRAClient",
        shares=_fedper_top,
        local_dp=_LORA_DP,
        adapter="lora",
    ),
    MethodSpec(
        "fedpara-lora",
        VLM,
        "FedPara: a shared and a private LoRA pair per layer, dW = (B_g A_g) * (B_p A_p) (peft LoHa).",
        "fedvlm.strategies.lora:LoRAStrategy",
        "fedvlm.client_app.lora_clients:FedParaClient",
        shares=_fedpara_global,
        local_dp=_LORA_DP,
        adapter="loha",
    ),
    _reprogram(
        "reprogram",
        "mr",
        "Reprogrammable-FL: a frozen source classifier; only the input program "
        "tanh(M*Theta) around the zero-padded image and the linear output map train, with DP-SGD (Opacus) "
        "and FedAvg.",
    ),
    _reprogram(
        "bl-ff",
        "ff",
        "Reprogrammable-FL's full fine-tune baseline: every weight of the source network "
        "(GroupNorm for BatchNorm) and a new head, same DP-SGD and FedAvg.",
    ),
    _reprogram(
        "bl-pf",
        "pf",
        "Reprogrammable-FL's partial fine-tune baseline: only a new head on the frozen source features.",
    ),
    _reprogram(
        "bl-ts",
        "ts",
        "Reprogrammable-FL's from-scratch baseline: the source architecture from random "
        "weights (GroupNorm), every weight trains.",
    ),
):
    register_method(_spec)


class UnknownMethod(ValueError):
    pass


def get_method(name: str) -> MethodSpec:
    try:
        return METHODS[name]
    except KeyError:
        raise UnknownMethod(
            f"run config 'method' = {name!r} is not a known method; accepted: {', '.join(METHODS)}"
        ) from None


def methods_of(family: Family) -> list[MethodSpec]:
    return [m for m in METHODS.values() if m.family is family]
