"""A node's own privacy floor, and its ledger of what it released.

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
After it trains, the round goes in its ledger (round, noise multiplier, steps, sampling rate,
epsilon so far), kept in its private state and so persisted with it (``client_app.state``),
never rolled back. A round trained again after a resume counts twice: the node's noise is
fresh OS entropy, so the two releases of the same records are independent.

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
    sigma = instruction.local_sigma
    if sigma is None or not sigma > 0:
        raise NoiseRefused(f"the server sent no local noise level; {limit} does not allow training without it")
    shape = ClientShape(instruction.num_train, instruction.batch_size, instruction.local_steps)
    try:
        check_delta(floor.delta, shape.n_train, "this node's", f"lower its node config {DELTA}")
    except BudgetError as why:
        raise NoiseRefused(str(why)) from why
    z = sigma / valid_sensitivity(settings, *local.sensitivity(settings, shape))
    rate, steps = local.account_shape(settings, shape)
    this = GaussianReleases(z, steps, rate)
    planned = epsilon_spent(GaussianReleases(z, steps * cfg.num_server_rounds, rate), floor.delta, settings.accountant)
    spent = epsilon_spent([*_releases(history), this], floor.delta, settings.accountant)
    what = (
        f"sigma {sigma:.4g} (noise multiplier {z:.4g}), {steps} step(s) a round at sampling rate {rate:.4g} over "
        f"{shape.n_train} records, {settings.accountant} accountant"
    )
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
    return {
        "round": instruction.server_round,
        "noise-multiplier": z,
        "steps": steps,
        "sampling-rate": rate,
        "epsilon": spent,
    }


def guard(
    node_config: dict, state: RecordDict, cfg: RunConfig, instruction: TrainInstruction, noise_source: str
) -> dict | None:
    """Refuse the round if the node's floor forbids it; else the row to record once it trained
    (None: the node states no floor)."""
    floor = NodeFloor.from_node_config(node_config)
    return None if floor is None else check_round(floor, cfg, instruction, load_ledger(state), noise_source)


def record(state: RecordDict, row: dict) -> float:
    """Add a trained round to the node's ledger; the epsilon its records have spent."""
    rows = [*load_ledger(state), row]
    save_meta(state, {k: [r[k] for r in rows] for k in COLUMNS}, LEDGER)
    return float(row["epsilon"])
