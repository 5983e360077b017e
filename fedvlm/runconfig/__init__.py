"""The run config: the typed, read-only ``RunConfig`` and the checks that need no method.

``check_keys`` fails with a ``ConfigError`` that names the key, the value and what is accepted,
for unknown keys, wrong types and values out of range or not among the choices; ``finish``
checks what the resolved values must satisfy (data roots, absolute paths) and fills in the
default directories. What a family or method decides, and the combinations it cannot run, are
applied between the two by ``methods.validation.validate``, the one entry point.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedvlm.errors import PublicError
from fedvlm.runconfig import datasets
from fedvlm.runconfig.schema import AUTO, DEFAULTS, KEY_BY_NAME, KEYS, Key, RunConfig
from fedvlm.utils.paths import default_cache_dir, default_output_dir

__all__ = ["AUTO", "ConfigError", "RunConfig", "check_keys", "finish", "parse_value", "KEYS", "KEY_BY_NAME", "DEFAULTS"]

# the datasets' facts the checks read, from the one catalogue (runconfig.datasets)
DATASETS_NEEDING_ROOT = datasets.NEEDING_ROOT
VLM_DATASETS = datasets.IMAGE_TEXT
DATASETS_WITH_OPTIONAL_ROOT = datasets.OPTIONAL_ROOT
WEIGHT_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".safetensors"})


def weights_path(value: str) -> Path | None:
    """clip.pretrained as a checkpoint path (None: an open_clip tag, or empty)."""
    if os.sep in value or Path(value).suffix in WEIGHT_SUFFIXES:
        return Path(value).expanduser()
    return None


def pins(pin: str, fingerprint: str | None) -> bool:
    """Whether run config 'backbone-fingerprint' = ``pin`` admits weights of ``fingerprint``:
    no pin admits any; a pin is the whole fingerprint or its last part (the hash's hex digits)."""
    return not pin or (fingerprint is not None and pin in (fingerprint, fingerprint.rsplit(":", 1)[-1]))


def parse_value(text: str):
    """A command-line ``KEY=VALUE``'s value: an int, a float, true/false, else the string."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


class ConfigError(PublicError, ValueError):
    """A run config that cannot be run; the message says which key and how to fix it."""


def _type_ok(key: Key, value: Any) -> bool:
    if key.kind is bool:
        return isinstance(value, bool)
    if key.kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if key.kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, key.kind)


def _check_value(key: Key, value: Any) -> str | None:
    if key.auto and value == AUTO:
        return None
    if not _type_ok(key, value):
        also = " or 'auto' (the method or its family decides)" if key.auto else ""
        return f"must be of type {key.kind.__name__}{also}, got {type(value).__name__} {value!r}"
    if key.kind is float and not math.isfinite(value):
        # NaN passes every comparison below, and would switch a feature off silently
        # (privacy.epsilon = nan: no noise; privacy.max-epsilon = nan: no cap)
        return "must be a finite number"
    if key.choices is not None and value not in key.choices:
        return f"accepted values: {', '.join(repr(c) for c in key.choices)}"
    also = ", or 'auto' (the method or its family decides)" if key.auto else ""
    if key.min is not None:
        if value < key.min or (key.min_exclusive and value == key.min):
            return f"must be {'>' if key.min_exclusive else '>='} {key.min}{also}"
    if key.max is not None and value > key.max:
        return f"must be <= {key.max}{also}"
    if key.check is not None:
        return key.check(value)
    return None


EMBEDDED_CLASSIFICATION = datasets.EMBEDDED_CLASSIFICATION
# Reprogrammable-FL's embedded sources (``models.embedded_resnet.SOURCES``; named here so that
# checking a run config needs no torch) and the one each embedded dataset reprograms by default:
# the motifs task its own source domain's, the others the small shapes source.
EMBEDDED_SOURCES = ("embedded-motif-resnet", "embedded-motif-resnet-ls", "embedded-tiny-resnet")
EMBEDDED_SOURCE_INPUT = 32
TORCHVISION_SOURCE_INPUT = 224


def resolve_derived(values: dict) -> None:
    """The 'auto' values that follow from other keys whatever the method (after the family has
    chosen the dataset): the LoRA learning rate from the VLM, Reprogrammable-FL's source model,
    batch size and image side from the data."""
    if values["lora.lr"] == AUTO:
        values["lora.lr"] = 3e-3 if values["vlm.model"] == "embedded-tiny-vlm" else 3e-4
    embedded_data = values["dataset"] in EMBEDDED_CLASSIFICATION
    if values["reprogram.source-model"] == AUTO:
        values["reprogram.source-model"] = (
            "embedded-motif-resnet"
            if values["dataset"] == "motifs"
            else ("embedded-tiny-resnet" if embedded_data else "resnet50")
        )
    embedded_source = values["reprogram.source-model"] in EMBEDDED_SOURCES
    if values["reprogram.batch-size"] == AUTO:
        values["reprogram.batch-size"] = 32 if embedded_data else 256
    if values["reprogram.image-size"] == AUTO:
        values["reprogram.image-size"] = 24 if embedded_source else 200


def check_reprogram(cfg: RunConfig) -> None:
    """The combinations Reprogrammable-FL cannot run."""
    embedded_source = cfg.reprogram.source_model in EMBEDDED_SOURCES
    source_size = EMBEDDED_SOURCE_INPUT if embedded_source else TORCHVISION_SOURCE_INPUT
    if cfg.reprogram.image_size > source_size:
        raise ConfigError(
            f"run config 'reprogram.image-size' = {cfg.reprogram.image_size} exceeds the source "
            f"model's input size {source_size}: the image is zero-padded up to it"
        )
    if cfg.privacy.calibration == "paper":
        raise ConfigError(
            "run config 'privacy.calibration' = 'paper' is DP-FPL's closed form; Reprogrammable-FL "
            "runs DP-SGD with an accountant: set privacy.calibration='accountant'"
        )
    if cfg.privacy.clipping == "per-batch":
        raise ConfigError(
            "run config 'privacy.clipping' = 'per-batch' does not apply to Reprogrammable-FL: its "
            "DP-SGD (Opacus) always clips per sample; set privacy.clipping='per-sample'"
        )


def check_keys(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Every key of ``raw`` known and of the right type and range; missing keys take their
    defaults."""
    unknown = [k for k in raw if k not in KEY_BY_NAME]
    if unknown:
        lines = []
        for k in sorted(unknown):
            close = difflib.get_close_matches(k, KEY_BY_NAME, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            lines.append(f"unknown run-config key {k!r}{hint}")
        raise ConfigError("; ".join(lines) + ". `python -m fedvlm.runconfig keys` lists every key.")

    values = {**DEFAULTS, **dict(raw)}
    errors = []
    for key in KEYS:
        problem = _check_value(key, values[key.name])
        if problem:
            shown = repr(values[key.name])
            shown = shown if len(shown) <= 120 else f"{shown[:100]}... ({len(shown):,} characters)"
            errors.append(f"run config {key.name!r} = {shown}: {problem}")
    if errors:
        raise ConfigError("; ".join(errors))
    return values


def finish(values: dict[str, Any]) -> dict[str, Any]:
    """The checks on resolved values that no method changes, and the default directories."""
    if values["privacy.max-epsilon"] and values["privacy.epsilon"] > values["privacy.max-epsilon"]:
        raise ConfigError(
            f"run config 'privacy.epsilon' = {values['privacy.epsilon']} exceeds 'privacy.max-epsilon' = "
            f"{values['privacy.max-epsilon']}; lower privacy.epsilon or raise privacy.max-epsilon"
        )

    if values["dataset"] in DATASETS_NEEDING_ROOT and not values["data-root"]:
        raise ConfigError(
            f"run config 'dataset' = {values['dataset']!r} needs 'data-root': the directory that "
            "holds (or, with download=true, will hold) its files"
        )
    if values["dataset"] not in DATASETS_NEEDING_ROOT | DATASETS_WITH_OPTIONAL_ROOT and values["data-root"]:
        raise ConfigError(
            f"run config 'data-root' = {values['data-root']!r} is set but dataset "
            f"{values['dataset']!r} is generated in-process and reads no files; remove data-root "
            "or pick a file-backed dataset"
        )
    # weights named by a path: Flower runs the apps wherever its processes started, so a relative
    # path would resolve there (a Hugging Face id such as org/name is not a path)
    weights = weights_path(values["clip.pretrained"])
    if weights is not None and not weights.is_absolute():
        raise ConfigError(
            f"run config 'clip.pretrained' = {values['clip.pretrained']!r} is a relative path: give the checkpoint's "
            "absolute path"
        )
    vlm = values["vlm.model"]
    if vlm.startswith(("./", "../")) or (os.sep in vlm and not vlm.startswith(("/", "~")) and Path(vlm).exists()):
        raise ConfigError(
            f"run config 'vlm.model' = {vlm!r} is a relative path (a directory here): give its absolute path, or a "
            "Hugging Face id"
        )
    for path_key in ("output-dir", "cache-dir", "data-root"):
        if values[path_key] and not Path(values[path_key]).expanduser().is_absolute():
            raise ConfigError(
                f"run config {path_key!r} = {values[path_key]!r} must be an absolute path: the "
                "ServerApp and ClientApps run in whatever directory their Flower process was started in"
            )
    values["cache-dir"] = str(Path(values["cache-dir"]).expanduser() if values["cache-dir"] else default_cache_dir())
    values["output-dir"] = str(
        Path(values["output-dir"]).expanduser() if values["output-dir"] else default_output_dir()
    )
    if values["data-root"]:
        values["data-root"] = str(Path(values["data-root"]).expanduser())
    return values
