"""Vision-language models for the LoRA methods (FedRand and its baselines).

One code path for every model: a Hugging Face image-text-to-text checkpoint (hub id or local
directory, loaded by ``AutoModelForImageTextToText`` and ``AutoProcessor``) or the embedded
tiny VLM, which ``models.tiny_vlm`` pretrains here and saves in the same format. Everything is
frozen; an adapter (LoRA, or LoHa for FedPara's Hadamard product) goes on the language
model's linear layers only, so the vision tower and the projector never train.

``VLM`` turns (image, prompt, target) triples into model batches: the processor's chat
template (or ``<image> prompt`` for a processor without one) makes the prompt, the target and
the end-of-sequence token follow it, and only the target's tokens carry labels.
"""

from __future__ import annotations

import hashlib
import logging
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from fedvlm.models import tiny_vlm
from fedvlm.models.tiny_vlm import EMBEDDED_VLM_NAME
from fedvlm.models.vlm_batching import VLM
from fedvlm.runconfig import RunConfig
from fedvlm.utils.progress import interactive

log = logging.getLogger(__name__)

# Where the language model's decoder layers sit in the module tree of common VLM families
# (LLaVA: model.language_model.layers.N, Idefics3/SmolVLM: model.text_model.layers.N,
# TinyLLaVA: language_model.model.layers.N or llm...).
DEFAULT_LM_PATTERN = r"(?:language_model|text_model|llm)"
LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


class VLMLoadError(RuntimeError):
    """A model that cannot be loaded; the message says what to fetch or change."""


def _hf_offline_context():
    from fedvlm.models.clip_loader import _hf_offline, _hub_reachable

    return _hf_offline() if not _hub_reachable() else _nullcontext()


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@contextmanager
def _quiet_loading():
    """transformers draws a 'Loading weights' bar on every load, in logs too (each client of a run
    loads the model); off where ``progress.interactive`` says no bars, restored after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if was and not interactive():
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def resolve_model_path(name: str, cache_dir: Path) -> str:
    """The embedded model's directory (pretrained on first use), or ``name`` unchanged."""
    if name == EMBEDDED_VLM_NAME:
        return str(tiny_vlm.ensure_pretrained(cache_dir))
    return name


def load_model_and_processor(name: str, cache_dir: Path, trust_remote_code: bool = False, dtype: str = "auto"):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = resolve_model_path(name, cache_dir)
    torch_dtype = {
        "auto": torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }[dtype]
    try:
        with _hf_offline_context(), _quiet_loading():
            processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
            model = AutoModelForImageTextToText.from_pretrained(
                path, trust_remote_code=trust_remote_code, dtype=torch_dtype
            )
    except (OSError, ValueError) as err:
        local = Path(path).expanduser().exists()
        hint = (
            "the directory exists but is not a transformers checkpoint with a processor"
            if local
            else "it is neither a local directory nor in the Hugging Face cache, and this machine may be offline; "
            f"on a machine with network run `huggingface-cli download {path}` (or save_pretrained the model "
            "and processor to a directory) and set vlm.model to that directory"
        )
        extra = (
            "" if trust_remote_code else "; models with custom code (TinyLLaVA) also need vlm.trust-remote-code=true"
        )
        raise VLMLoadError(
            f"vlm.model = {name!r} could not be loaded: {hint}{extra} ({type(err).__name__}: {err})"
        ) from err
    ensure_pad_token(processor, name)
    return model, processor


def ensure_pad_token(processor, name: str) -> None:
    """Batches of prompts of different lengths are padded: a tokenizer that has no pad token
    (many decoder-only LMs) pads with its end-of-sequence token, which the attention mask hides
    and generation stops at anyway."""
    tok = getattr(processor, "tokenizer", processor)
    if tok.pad_token is not None:
        return
    if tok.eos_token is None:
        raise VLMLoadError(
            f"vlm.model = {name!r}: its tokenizer has neither a pad nor an end-of-sequence token, so prompts of "
            "different lengths cannot be batched; set tokenizer.pad_token in the checkpoint's tokenizer_config.json"
        )
    tok.pad_token = tok.eos_token
    log.info("%s: the tokenizer has no pad token; padding with its end-of-sequence token %r", name, tok.eos_token)


def lora_target_regex(targets: list[str], lm_pattern: str = DEFAULT_LM_PATTERN) -> str:
    """A peft ``target_modules`` regex: the named linear layers inside the language model only."""
    names = "|".join(re.escape(t) for t in targets)
    return rf".*{lm_pattern}\..*\.(?:{names})$"


def layer_of(param_name: str) -> int | None:
    m = LAYER_INDEX.search(param_name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class AdapterSpec:
    kind: str  # "lora" | "loha"
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    lm_pattern: str = DEFAULT_LM_PATTERN

    @classmethod
    def from_config(cls, cfg: RunConfig, kind: str) -> AdapterSpec:
        """The run's adapter: its method's kind (``MethodSpec.adapter``), the ``lora.*`` keys."""
        targets = tuple(t.strip() for t in cfg.lora.target_modules.split(",") if t.strip())
        return cls(kind, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, targets, cfg.vlm.language_model_pattern)


def add_adapter(model: torch.nn.Module, spec: AdapterSpec, seed: int) -> torch.nn.Module:
    """Wrap ``model`` with a peft adapter; every base weight stays frozen. The adapter's
    initial values come from ``seed`` so that the server and every client agree on them."""
    from peft import LoHaConfig, LoraConfig, get_peft_model

    regex = lora_target_regex(list(spec.targets), spec.lm_pattern)
    config: LoraConfig | LoHaConfig
    if spec.kind == "lora":
        config = LoraConfig(
            r=spec.rank,
            lora_alpha=spec.alpha,  # type: ignore[arg-type]  # peft says int; a float scale works
            lora_dropout=spec.dropout,
            target_modules=regex,
        )
    elif spec.kind == "loha":
        config = LoHaConfig(
            r=spec.rank,
            alpha=spec.alpha,  # type: ignore[arg-type]  # peft says int; a float scale works
            rank_dropout=0.0,
            module_dropout=0.0,
            target_modules=regex,
        )
    else:
        raise ValueError(f"unknown adapter kind {spec.kind!r}")
    for p in model.parameters():
        p.requires_grad_(False)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        with warnings.catch_warnings():
            # peft 0.21 reads transformers' deprecated `is_gradient_checkpointing` alias: a warning
            # about peft's code, once per client in every log, that no setting of ours can act on
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            wrapped = get_peft_model(model, config)
    except ValueError as err:
        raise VLMLoadError(
            f"no layer of the language model matches lora.target-modules={','.join(spec.targets)} "
            f"(pattern {regex}); list the model's linear layer names (e.g. q_proj,v_proj) or set "
            f"vlm.language-model-pattern ({err})"
        ) from err
    finally:
        torch.random.set_rng_state(state)
    return wrapped


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under stable names (peft's, without the 'base_model.model.' prefix
    and the adapter name), on the CPU."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[_short(name)] = p.detach().cpu().clone()
    return out


def _short(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".default.", ".").replace(".default", "")


def load_adapter_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    params = {_short(n): p for n, p in model.named_parameters() if p.requires_grad}
    unknown = set(tensors) - set(params)
    if unknown:
        raise KeyError(f"adapter tensors not in this model: {sorted(unknown)[:3]}")
    with torch.no_grad():
        for k, v in tensors.items():
            params[k].copy_(v.to(params[k].device, params[k].dtype))


def trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {_short(n): p for n, p in model.named_parameters() if p.requires_grad}


def fingerprint(model: torch.nn.Module, name: str) -> str:
    """A short hash of the frozen base weights (every node must hold the same model), taken
    before the adapter is added (``load_vlm``), so that no adapter weight enters it."""
    h = hashlib.sha256(name.encode())
    for k, p in sorted(model.state_dict().items())[:64]:
        h.update(k.encode())
        h.update(p.detach().float().cpu().flatten()[:256].numpy().tobytes())
    return h.hexdigest()[:16]


_LOADED: dict[tuple, tuple[VLM, dict[str, torch.Tensor], str]] = {}


def resolve_device(name: str) -> torch.device:
    from fedvlm.models.clip_loader import resolve_device as clip_device

    return clip_device(name)


def load_vlm(cfg: RunConfig, adapter_kind: str, device: str = "") -> tuple[VLM, dict[str, torch.Tensor], str]:
    """The run's frozen VLM with its method's adapter (``vlm.*``, ``AdapterSpec.from_config``), the
    adapter's initial values (seeded: every process gets the same) and the base model's
    fingerprint, on ``device`` (default: the run's). Cached per process: simulated nodes that
    share a worker share the model and load their own adapter values before each use."""
    adapter, name = AdapterSpec.from_config(cfg, adapter_kind), cfg.vlm.model
    dev = resolve_device(device or cfg.device)
    key = (name, str(cfg.cache_path), adapter, cfg.seed, str(dev), cfg.vlm.trust_remote_code, cfg.vlm.dtype)
    if key not in _LOADED:
        model, processor = load_model_and_processor(name, cfg.cache_path, cfg.vlm.trust_remote_code, cfg.vlm.dtype)
        fp = fingerprint(model, name)
        wrapped = add_adapter(model, adapter, cfg.seed)
        initial = adapter_state(wrapped)
        _LOADED[key] = (VLM(wrapped, processor, name, dev), initial, fp)
    return _LOADED[key]
