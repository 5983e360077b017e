"""A node's ledger of what it released, and its own privacy floor.

Every node that trains under a local mechanism covering what it uploads keeps one ledger of its
releases (round, noise multiplier, steps, sampling rate, epsilon so far), in its private state and
persisted with it (``client_app.state``), never rolled back: it is the node's one account of its
privacy, which the node reports when it states a limit (below) and from which a reprogramming
node's Opacus figures are computed (``client_app.reprogram_clients``). A round trained again (a
message asked again, a resumed run) counts twice when the node's noise is fresh OS entropy, since
the two releases of the same records are independent, and once with seeded noise, which releases
the very same tensor again (``prior``).

With local DP the server is the party the noise protects against, so a node cannot take the
server's word for how much noise is enough: the run config and the noise level both come from
the server, and a malicious or buggy one could send a tiny sigma with a config that agrees. An
organisation states its own limit in its node config::

    flower-supernode ... --node-config "data-dir='/data' max-epsilon=3.0 delta=1e-5"

Before every round it trains, the node recomputes with the run's accountant and its own delta
what a record of its data would spend, from what it will execute (this round's sigma, its
clip, local steps, batch size and record count):
- under the server's plan: every one of the run's ``num-server-rounds`` rounds at this noise;
- in fact: the rounds in its own ledger plus this one;
and refuses to train (the error reply names both numbers) if either exceeds ``max-epsilon``.
After it trains, the round goes in its ledger, and its reply carries the epsilon its records
have spent (``node-epsilon``).

The limit holds only for noise nobody else can regenerate. A node that states one never
defaults to noise derived from the run seed (``privacy.mechanisms.node_noise_source``), and one
whose node config asks for it (``noise-source='seeded'``) is refused here: anyone holding the
run config could subtract that noise from what the node releases.

A method whose upload is not post-processing of the node's noise (DP-FPL, FedOTP, FedPGP: the
trusted server sees each client's un-noised global-prompt gradient) gives no bound against the
server, and a run without privacy none at all: a node with a floor refuses both.
"""

from __future__ import annotations

from dataclasses import dataclass

from flwr.app import RecordDict

from fedvlm.client_app.state import LEDGER, load_meta, save_meta
from fedvlm.privacy.accounting import BudgetError, GaussianReleases, check_delta, epsilon_spent
from fedvlm.privacy.ledger import valid_sensitivity
from fedvlm.privacy.planner import ClientShape, NoiseRefused
from fedvlm.protocol import TrainInstruction
from fedvlm.runconfig import ConfigError, RunConfig

MAX_EPSILON, DELTA = "max-epsilon", "delta"  # the node config keys
COLUMNS = ("round", "noise-multiplier", "steps", "sampling-rate", "epsilon")


@dataclass(frozen=True)
class NodeFloor:
    max_epsilon: float
    delta: float

    @classmethod
    def from_node_config(cls, node_config: dict) -> NodeFloor | None:
        if MAX_EPSILON not in node_config:
            if DELTA in node_config:
                raise ConfigError(f"node config sets {DELTA} but not {MAX_EPSILON}: set both, or neither")
            return None
        try:
            eps, delta = float(node_config[MAX_EPSILON]), float(node_config.get(DELTA, "nan"))
        except (TypeError, ValueError):
            eps, delta = float("nan"), float("nan")
        if not eps > 0 or not 0 < delta < 1:
            raise ConfigError(
                f"node config {MAX_EPSILON} = {node_config.get(MAX_EPSILON)!r}, {DELTA} = {node_config.get(DELTA)!r}: "
                f"set {MAX_EPSILON} > 0 and 0 < {DELTA} < 1 (e.g. {MAX_EPSILON}=3.0 {DELTA}=1e-5)"
            )
        return cls(eps, delta)


def load_ledger(state: RecordDict) -> list[dict]:
    columns = load_meta(state, LEDGER)  # one list per column
    if not columns:
        return []
    return [dict(zip(COLUMNS, row, strict=True)) for row in zip(*(columns[k] for k in COLUMNS), strict=True)]


def _releases(rows: list[dict]) -> list[GaussianReleases]:
    return [GaussianReleases(r["noise-multiplier"], int(r["steps"]), r["sampling-rate"]) for r in rows]


def _limit(floor: NodeFloor) -> str:
    return f"this node's limit {MAX_EPSILON} = {floor.max_epsilon:g} (delta {floor.delta:g})"


def check_source(floor: NodeFloor | None, noise_source: str) -> None:
    """Refuse a limit on regenerable noise (the module docstring)."""
    if floor is not None and noise_source != "os":
        raise NoiseRefused(
            f"this node draws {noise_source} noise (node config noise-source): anyone holding the run config can "
            f"regenerate it and subtract it from what the node releases, so {_limit(floor)} would protect nothing; "
            "remove noise-source from the node config (a node with a limit draws from the OS)"
        )


def _release(cfg: RunConfig, instruction: TrainInstruction) -> tuple[GaussianReleases, str] | None:
    """What this round releases under the node's local noise, as the accountant reads it, and in
    words; None where that noise covers nothing that leaves the node (no privacy, no local
    mechanism, an upload the local noise does not cover, no noise level)."""
    settings, spec = cfg.privacy, cfg.spec
    if not settings.enabled or spec.local_dp is None:
        return None
    local = spec.local_dp(cfg)
    sigma = instruction.local_sigma
    if not local.noises_upload or sigma is None or not sigma > 0:
        return None
    shape = ClientShape(instruction.num_train, instruction.batch_size, instruction.local_steps)
    z = sigma / valid_sensitivity(settings, *local.sensitivity(settings, shape))
    rate, steps = local.account_shape(settings, shape)
    what = (
        f"sigma {sigma:.4g} (noise multiplier {z:.4g}), {steps} step(s) a round at sampling rate {rate:.4g} over "
        f"{shape.n_train} records, {settings.accountant} accountant"
    )
    return GaussianReleases(z, steps, rate), what


def _row(server_round: int, this: GaussianReleases, spent: float) -> dict:
    return {
        "round": server_round,
        "noise-multiplier": this.noise_multiplier,
        "steps": this.count,
        "sampling-rate": this.sampling_rate,
        "epsilon": spent,
    }


def check_round(
    floor: NodeFloor, cfg: RunConfig, instruction: TrainInstruction, history: list[dict], noise_source: str
) -> dict:
    """This round's ledger row if the node may train it under ``floor``; ``NoiseRefused`` naming
    the numbers otherwise."""
    check_source(floor, noise_source)
    settings, spec = cfg.privacy, cfg.spec
    limit = _limit(floor)
    if not settings.enabled or spec.local_dp is None:
        raise NoiseRefused(f"this run trains without privacy (no local noise), which {limit} does not allow")
    local = spec.local_dp(cfg)
    if not local.noises_upload:
        raise NoiseRefused(
            f"method {spec.name} uploads a tensor that its local noise ({local.name}) does not cover (its server is "
            f"trusted with un-noised updates), so nothing bounds what the server learns: {limit} does not allow it"
        )
    released = _release(cfg, instruction)
    if released is None:
        raise NoiseRefused(f"the server sent no local noise level; {limit} does not allow training without it")
    this, what = released
    try:
        check_delta(floor.delta, instruction.num_train, "this node's", f"lower its node config {DELTA}")
    except BudgetError as why:
        raise NoiseRefused(str(why)) from why
    whole_run = GaussianReleases(this.noise_multiplier, this.count * cfg.num_server_rounds, this.sampling_rate)
    planned = epsilon_spent(whole_run, floor.delta, settings.accountant)
    spent = epsilon_spent([*_releases(history), this], floor.delta, settings.accountant)
    if planned > floor.max_epsilon * (1 + 1e-9):
        raise NoiseRefused(
            f"the server's plan would spend epsilon = {planned:.4g} per record over {cfg.num_server_rounds} rounds "
            f"({what}), above {limit}; refusing to train"
        )
    if spent > floor.max_epsilon * (1 + 1e-9):
        raise NoiseRefused(
            f"this round would bring this node's records to epsilon = {spent:.4g} after {len(history) + 1} rounds "
            f"({what}), above {limit}; refusing to train"
        )
    return _row(instruction.server_round, this, spent)


@dataclass(frozen=True)
class Release:
    """The ledger row of a round the node is about to train, and whether it trains under its own
    limit (then its reply carries the epsilon its records have spent)."""

    row: dict
    limited: bool


def prior(state: RecordDict, server_round: int, fresh: bool) -> list[dict]:
    """The ledger before ``server_round``'s release. A round the node trains again (asked again,
    a resumed run) is a second release when its noise is fresh (``fresh``: OS noise) and counts
    twice; with seeded noise it is the same release, so its earlier row gives way to the new one."""
    rows = load_ledger(state)
    return rows if fresh else [r for r in rows if int(r["round"]) != server_round]


def guard(
    node_config: dict, state: RecordDict, cfg: RunConfig, instruction: TrainInstruction, noise_source: str
) -> Release | None:
    """Refuse the round if the node's floor forbids it; else what to record once it trained
    (None: this round releases nothing the node's local noise covers)."""
    floor = NodeFloor.from_node_config(node_config)
    history = prior(state, instruction.server_round, noise_source == "os")
    if floor is not None:
        return Release(check_round(floor, cfg, instruction, history, noise_source), limited=True)
    released = _release(cfg, instruction)
    if released is None:
        return None
    this, _ = released
    spent = epsilon_spent([*_releases(history), this], cfg.privacy.delta, cfg.privacy.accountant)
    return Release(_row(instruction.server_round, this, spent), limited=False)


def record(state: RecordDict, release: Release, fresh: bool) -> float:
    """Add a trained round to the node's ledger (``prior``'s rule for a round trained again); the
    epsilon its records have spent."""
    rows = [*prior(state, int(release.row["round"]), fresh), release.row]
    save_meta(state, {k: [r[k] for r in rows] for k in COLUMNS}, LEDGER)
    return float(release.row["epsilon"])
