"""The one entry point from Flower's flat run config to a checked, read-only ``RunConfig``.

``validate`` checks every key (``runconfig.check_keys``), resolves what the method's family and
the method itself decide (their entries in ``methods.registry``), runs their checks and the
run-wide ones (``runconfig.finish``), and fails with a ``ConfigError`` that names the key, the
value and the fix. The server runs it once before anything starts and every node runs it on the
config it receives, so both sides act on the same values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedvlm.methods.registry import METHODS, UnknownMethod, get_method
from fedvlm.privacy.accountants import REFERENCE
from fedvlm.runconfig import (
    AUTO,
    KEY_BY_NAME,
    VLM_DATASETS,
    ConfigError,
    RunConfig,
    check_keys,
    finish,
    resolve_derived,
)
from fedvlm.spec import Family, shares_nothing, spec_of

# what 'auto' means for a key no method decided: full local epochs (PromptFL's and CoOp's setting)
_UNDECIDED = {"prompt.local-steps": 0}


def _family_decides(values: dict, family: Family) -> None:
    """The keys left to the family (``auto``) set from it; its evaluations and noise checked."""
    family_decides = {
        "dataset": family.default_dataset,
        "partitioner": family.default_partitioner,
        "dirichlet-alpha": family.dirichlet_alpha,
        "fraction-train": family.fraction_train,
        "privacy.clip": family.privacy_clip,
    }
    for key, value in family_decides.items():
        if values[key] == AUTO:
            values[key] = value
    if values["class-split"] not in family.class_splits:
        raise ConfigError(
            f"run config 'class-split' = {values['class-split']!r} is not an evaluation the {family.name} family "
            f"has; accepted: {', '.join(family.class_splits)}"
        )
    if values["privacy.noise-multiplier"] == AUTO:
        # the family's fixed noise is the default only when no epsilon is asked for
        values["privacy.noise-multiplier"] = 0.0 if values["privacy.epsilon"] > 0 else family.noise_multiplier
    elif values["privacy.noise-multiplier"] > 0 and values["privacy.epsilon"] > 0:
        raise ConfigError(
            f"run config sets both 'privacy.epsilon' = {values['privacy.epsilon']} (calibrate the noise to it) and "
            f"'privacy.noise-multiplier' = {values['privacy.noise-multiplier']} (fixed noise, epsilon only reported); "
            "set one of them, the other to 0"
        )


def validate(raw: Mapping[str, Any]) -> RunConfig:
    """Check every key of ``raw`` (missing keys take their defaults), resolve what the family
    and the method decide, and run their checks; a ``ConfigError`` names the key and the fix."""
    values = check_keys(raw)
    try:
        method = get_method(values["method"])
    except UnknownMethod as err:
        raise ConfigError(str(err)) from None
    family = method.family
    _family_decides(values, family)
    resolve_derived(values)
    if (values["dataset"] in VLM_DATASETS) != family.image_text:
        fitting = (
            sorted(VLM_DATASETS)
            if family.image_text
            else [d for d in KEY_BY_NAME["dataset"].choices or () if d not in VLM_DATASETS and d != AUTO]
        )
        raise ConfigError(
            f"run config 'dataset' = {values['dataset']!r} does not fit method {method.name!r} "
            f"({'image-text' if family.image_text else 'image classification'} data needed); "
            f"accepted: {', '.join(fitting)}"
        )
    private = values["privacy.epsilon"] > 0 or values["privacy.noise-multiplier"] > 0
    for key, value in {**_UNDECIDED, **method.defaults, **(method.dp_defaults if private else {})}.items():
        if values[key] == AUTO:  # the method decides
            values[key] = value
    if private and not method.supports_dp:
        dp_methods = ", ".join(m.name for m in METHODS.values() if m.supports_dp)
        raise ConfigError(
            f"run config 'privacy.epsilon' = {values['privacy.epsilon']} but method {method.name!r} "
            f"has no DP mechanism; set privacy.epsilon=0 or use one of: {dp_methods}"
        )
    cfg = RunConfig.from_flat(finish(values), method)
    # what the family and the method cannot run, on the typed config
    for check in (family.check, method.check, _check_rank if method.rank_key else None, _check_audit, _check_secure):
        if check is not None:
            check(cfg)
    return cfg


def _check_audit(cfg: RunConfig) -> None:
    """The one-run audit scores canaries in a per-record DP-SGD mechanism (``privacy.canaries``)."""
    m = cfg.privacy.audit_canaries
    if not m:
        return
    if not cfg.privacy.enabled:
        raise ConfigError(
            f"run config 'privacy.audit-canaries' = {m} audits a DP mechanism but privacy is off; set "
            "privacy.epsilon or privacy.noise-multiplier, or privacy.audit-canaries=0"
        )
    mechanism = spec_of(cfg).local_dp
    assert mechanism is not None  # privacy on: validate refused methods without a mechanism
    local = mechanism(cfg)
    if local.per_participation:
        raise ConfigError(
            f"run config 'privacy.audit-canaries' = {m}: the {local.name} mechanism noises each round's whole "
            "update once, with no per-record step for a canary to enter; audit a per-step placement instead "
            "(e.g. pfedmoap.dp-placement='step')"
        )


def _check_secure(cfg: RunConfig) -> None:
    """Secure aggregation needs a method whose server aggregates sums of uploads, a bound each node
    clips its own update to where no DP clip bounds it, and, with distributed noise, an accountant
    that composes its zCDP bound (``privacy.distributed``)."""
    settings, spec = cfg.secure_aggregation, spec_of(cfg)
    if not settings.enabled:
        return
    why = spec.individual_uploads or (
        "it does not train"
        if not spec.trains
        else "its clients send nothing to aggregate"
        if spec.shares is shares_nothing
        else ""
    )
    if why:
        raise ConfigError(
            f"run config 'secure-aggregation.enabled' = true, but method {spec.name!r} cannot use it: {why}; "
            "set secure-aggregation.enabled=false"
        )
    noised = cfg.privacy.enabled and spec.global_dp is not None
    if not noised and cfg.replies.max_norm <= 0:
        raise ConfigError(
            "run config 'secure-aggregation.enabled' = true needs an absolute bound on a client's update, which "
            "every node then clips its own update to (the server can no longer see, and bound, one update): set "
            "replies.max-norm > 0 (e.g. replies.max-norm=10)"
        )
    if settings.neighbours % 2:
        raise ConfigError(
            f"run config 'secure-aggregation.neighbours' = {settings.neighbours}: SecAgg+'s graph needs an even "
            "degree (0 = every other client)"
        )
    if noised and cfg.privacy.accountant != REFERENCE:
        raise ConfigError(
            f"run config 'privacy.accountant' = {cfg.privacy.accountant!r}: under secure aggregation the global "
            "noise is the clients' distributed discrete Gaussian, whose guarantee is a zCDP bound only a Renyi "
            f"accountant composes; set privacy.accountant={REFERENCE!r}"
        )


def _check_rank(cfg: RunConfig) -> None:
    """A low-rank prompt's rank (the method's ``rank_key``) is at most its M context tokens (with a
    ``prompt.ctx-init`` phrase M is its token count, known once tokenised:
    ``models.lowrank.factorize`` checks)."""
    key = spec_of(cfg).rank_key
    rank = cfg.as_dict()[key]
    if not cfg.prompt.ctx_init and rank > cfg.prompt.n_ctx:
        raise ConfigError(
            f"run config {key!r} = {rank} exceeds the {cfg.prompt.n_ctx} context tokens "
            f"(prompt.n-ctx); use a rank of at most {cfg.prompt.n_ctx}"
        )
