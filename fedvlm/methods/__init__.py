"""The method registry: one name per method, mapped to its family, its server strategy, its
client trainer and the names of the tensors it may share.

Adding a method means one entry here, a strategy class and a client class; nothing else
dispatches on method names. Strategy and client classes are named by import path so that a
client process never imports server code and vice versa.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from fedvlm.privacy.planner import LocalDP


@dataclass(frozen=True)
class Family:
    """Defaults shared by a family of methods (what 'auto' resolves to)."""

    name: str
    default_dataset: str
    default_partitioner: str
    dirichlet_alpha: float  # what dirichlet-alpha = 0 means (the family's papers' value)
    fraction_train: float  # what fraction-train = 0 means
    privacy_clip: float = 10.0  # what privacy.clip = -1 means
    noise_multiplier: float = 0.0  # what privacy.noise-multiplier = -1 means (0: calibrate to epsilon)


@dataclass(frozen=True)
class MethodSpec:
    name: str
    family: str
    summary: str
    strategy: str  # "module:Class" of the server strategy
    client: str  # "module:Class" of the client trainer
    shared: frozenset[str] = field(default_factory=frozenset)  # tensors that may leave a client
    trains: bool = True
    defaults: dict = field(default_factory=dict)  # what -1 / "auto" keys mean for this method
    # the local-DP mechanism its clients run when privacy is on (a function of the run config);
    # None: no DP mechanism
    local_dp: Callable[[Mapping], LocalDP] | None = None

    @property
    def supports_dp(self) -> bool:
        return self.local_dp is not None

    def strategy_class(self):
        return _load(self.strategy)

    def client_class(self):
        return _load(self.client)


def _dp(name: str, where: str, tensors: int = 1) -> Callable[[Mapping], LocalDP]:
    return lambda cfg: LocalDP(name, where, tensors)


def _dpfpl_local(cfg: Mapping) -> LocalDP:
    if cfg["dpfpl.rank"]:
        return LocalDP("ldp-lowrank", "client: gradients of u and v (the local prompt's rank-k factors) at every "
                       "local step", 2)
    return LocalDP("ldp-local", "client: gradient of the full-rank local prompt at every local step")


def _load(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


# DP-SGD on the whole adapter (one per-sample clip over all its tensors), so whatever part a
# LoRA method sends is post-processing of noised steps
_LORA_DP = _dp("ldp-adapter", "client: per-sample-clipped gradient of the whole adapter at every local step "
               "(DP-SGD); the tensors sent are post-processing")

FAMILIES: dict[str, Family] = {
    "prompt": Family("prompt", "embedded", "pathological", 0.3, 1.0),
    "vlm": Family("vlm", "embedded-captions", "dirichlet", 0.5, 0.3),
    # Reprogrammable-FL: 3 clients, IID, all of them every round, DP-SGD with C = 1, z = 1.1
    "reprogram": Family("reprogram", "digits", "iid", 0.5, 1.0, privacy_clip=1.0, noise_multiplier=1.1),
}

METHODS: dict[str, MethodSpec] = {
    m.name: m
    for m in (
        MethodSpec(
            "promptfl", "prompt",
            "PromptFL: one shared prompt, FedAvg weighted by client data size (optional FedProx).",
            "fedvlm.strategies.prompt:PromptFLStrategy", "fedvlm.client_app.prompt_clients:PromptFLClient",
            shared=frozenset({"ctx"}), defaults={"prompt.local-steps": 0},
            local_dp=_dp("ldp-prompt", "client: gradient of the prompt at every local step (the shared prompt is "
                         "post-processing)"),
        ),
        MethodSpec(
            "coop", "prompt",
            "CoOp trained locally: every client learns its own prompt; nothing is aggregated.",
            "fedvlm.strategies.prompt:LocalOnlyStrategy", "fedvlm.client_app.prompt_clients:CoOpClient",
            defaults={"prompt.local-steps": 0},
        ),
        MethodSpec(
            "zeroshot", "prompt",
            "Zero-shot CLIP with a hand-written template; evaluation only.",
            "fedvlm.strategies.prompt:EvaluateOnlyStrategy", "fedvlm.client_app.prompt_clients:ZeroShotClient",
            trains=False, defaults={"prompt.local-steps": 0},
        ),
        MethodSpec(
            "dpfpl", "prompt",
            "DP-FPL: global prompt (server, global DP) + private local prompt factorised every step "
            "into u v + residual (local DP on the gradients of u and v).",
            "fedvlm.strategies.global_local:GlobalGradientStrategy", "fedvlm.client_app.global_local_clients:DPFPLClient",
            shared=frozenset({"global_grad"}), defaults={"prompt.local-steps": 1}, local_dp=_dpfpl_local,
        ),
        MethodSpec(
            "fedotp", "prompt",
            "FedOTP: global + local prompt per class, matched to image patches by unbalanced optimal "
            "transport; global DP on the global prompt, local DP on the local prompt.",
            "fedvlm.strategies.global_local:GlobalGradientStrategy", "fedvlm.client_app.global_local_clients:FedOTPClient",
            shared=frozenset({"global_grad"}), defaults={"prompt.local-steps": 1},
            local_dp=_dp("ldp-local", "client: gradient of the full-rank local prompt at every local step"),
        ),
        MethodSpec(
            "fedpgp", "prompt",
            "FedPGP: global prompt + low-rank personal u v (factorised once) with a prompt-wise contrastive "
            "term; global DP on the global prompt, local DP on u and v.",
            "fedvlm.strategies.global_local:GlobalGradientStrategy", "fedvlm.client_app.global_local_clients:FedPGPClient",
            shared=frozenset({"global_grad"}), defaults={"prompt.local-steps": 1},
            local_dp=_dp("ldp-lowrank", "client: gradients of the low-rank personal factors u and v at every local "
                         "step", 2),
        ),
        MethodSpec(
            "fedrand", "vlm",
            "FedRand: LoRA on the VLM's language model; each round the server sends every sampled client "
            "one randomly drawn half (all A or all B), the other half stays private; per-half averaging.",
            "fedvlm.strategies.lora:FedRandStrategy", "fedvlm.client_app.lora_clients:FedRandClient",
            local_dp=_LORA_DP,
        ),
        MethodSpec(
            "fedavg-lora", "vlm",
            "FedAvg on the full LoRA adapter (both halves both ways): FedRand's oracle baseline.",
            "fedvlm.strategies.lora:FedAvgLoRAStrategy", "fedvlm.client_app.lora_clients:FedAvgLoRAClient",
            local_dp=_LORA_DP,
        ),
        MethodSpec(
            "fedper-lora", "vlm",
            "FedPer: the top layers' LoRA is shared (fedper.shared-layers), the rest stays on the client.",
            "fedvlm.strategies.lora:FedPerStrategy", "fedvlm.client_app.lora_clients:FedPerClient",
            local_dp=_LORA_DP,
        ),
        MethodSpec(
            "fedpara-lora", "vlm",
            "FedPara: a shared and a private LoRA pair per layer, dW = (B_g A_g) * (B_p A_p) (peft LoHa).",
            "fedvlm.strategies.lora:FedParaStrategy", "fedvlm.client_app.lora_clients:FedParaClient",
            local_dp=_LORA_DP,
        ),
        *(
            MethodSpec(
                name, "reprogram", summary,
                "fedvlm.strategies.reprogram:ReprogramStrategy", f"fedvlm.client_app.reprogram_clients:{cls}",
                local_dp=_dp("dp-sgd", "client: DP-SGD (Opacus) on every trainable parameter: each sample's whole "
                             "gradient clipped to C, Gaussian noise on the sum of a Poisson batch, divided by its "
                             "expected size"),
            )
            for name, cls, summary in (
                ("reprogram", "ReprogramClient",
                 "Reprogrammable-FL: a frozen source classifier; only the input program tanh(M*Theta) around the "
                 "zero-padded image and the linear output map train, with DP-SGD (Opacus) and FedAvg."),
                ("bl-ff", "FullFineTuneClient",
                 "Reprogrammable-FL's full fine-tune baseline: every weight of the source network (GroupNorm for "
                 "BatchNorm) and a new head, same DP-SGD and FedAvg."),
                ("bl-pf", "PartialFineTuneClient",
                 "Reprogrammable-FL's partial fine-tune baseline: only a new head on the frozen source features."),
                ("bl-ts", "FromScratchClient",
                 "Reprogrammable-FL's from-scratch baseline: the source architecture from random weights "
                 "(GroupNorm), every weight trains."),
            )
        ),
    )
}


class UnknownMethod(ValueError):
    pass


def get_method(name: str) -> MethodSpec:
    try:
        return METHODS[name]
    except KeyError:
        raise UnknownMethod(
            f"run config 'method' = {name!r} is not a known method; accepted: {', '.join(METHODS)}"
        ) from None
