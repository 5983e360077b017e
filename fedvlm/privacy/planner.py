"""The privacy planner: the noise of every mechanism of a run, and the epsilon a record gets.

Terms. Client k holds n_k records and takes s_k local steps per round on batches of expected
size B_k = min(B, n_k), Poisson-sampled with rate q_k = B_k / n_k (with the paper's
calibration: fixed-size uniform batches, q = 1, no amplification claimed). T rounds.

Mechanisms (``privacy.ledger.MechanismPlan``):
- local (client) DP: every local step, the per-sample-clipped gradient of the method's local
  tensors gets N(0, sigma_L,k^2); sensitivity sqrt(tensors) * C / B_k;
- global (server) DP, DP-FPL and its baselines: once per round the server adds N(0, sigma_G^2)
  to the average of the sampled clients' clipped global gradients, divided by a denominator N
  frozen at planning; a record of client k moves it by at most C / (N * B_k).

What protects a record is the composition of everything its records feed: a record of client
k spends, in every round k trains, its local steps AND its share of the global release.
``RecordAccount`` is that per-client view; with one local step per round the local and global
gradients come from the same Poisson batch, so a round is one subsampled Gaussian release with
the joint noise multiplier (z_L^-2 + z_G^-2)^-1/2 (``accounting.joint_noise_multiplier``);
otherwise the s_k local releases and the (unamplified) global one are composed.

Calibration (``privacy.calibration = accountant``): every mechanism is first calibrated alone to
``privacy.epsilon``, then all of them are scaled by one factor c >= 1 until every client's
composed epsilon meets the target. A client therefore always gets at least the local noise it
would compute for its own mechanism alone, which is what it checks (``required_local_sigma``)
before it trains: client-side DP protects against the server, so it must not rest on the
server's word.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

from fedvlm.errors import PublicError
from fedvlm.privacy.accounting import (
    BudgetError,
    GaussianReleases,
    Releases,
    ZCDpReleases,
    epsilon_spent,
    joint_noise_multiplier,
    smallest_scale,
)
from fedvlm.privacy.distributed import DistributedGaussian, granularity
from fedvlm.privacy.ledger import MechanismPlan, PrivacyLedger, plan_gaussian, valid_sensitivity
from fedvlm.protocol import LOCAL_SIGMA, LOCAL_STEPS, NUM_TRAIN, TrainInstruction
from fedvlm.runconfig.schema import PrivacyConfig, RunConfig

WRAP_PROBABILITY = 1e-9  # the most a round's distributed-noise sum may wrap around modulo 2^bits


class NoiseRefused(PublicError, RuntimeError):
    """A client was asked to train with less noise than its own plan requires, or with a plan
    its data cannot honour."""


@dataclass(frozen=True)
class LocalDP:
    """A method's local-DP mechanism: Gaussian noise on the per-sample-clipped gradients of
    ``tensors`` tensors (each clipped to C separately) at every local step; or, with
    ``per_participation``, on the node's whole update, clipped to C, once per round it trains
    (sensitivity 2C: with or without a record, both clipped updates lie in the C-ball; every
    record is in it, so no subsampling amplification)."""

    name: str
    where: str
    tensors: int = 1
    per_participation: bool = False
    note: str = ""  # what the ledger must say about this mechanism's coverage
    # whether what the node uploads is post-processing of this noise, so that it protects the
    # node's records against the server (DP-FPL's family: no, the upload is the un-noised
    # global-prompt gradient of its trusted-server model; this noise protects the local prompt)
    noises_upload: bool = True

    def sensitivity(self, settings: PrivacyConfig, client: ClientShape) -> tuple[float, float]:
        """(what the calibration assumes, what a record can change under per-batch clipping)."""
        root = math.sqrt(self.tensors)
        if self.per_participation:
            return root * 2 * settings.clip, root * 2 * settings.clip
        return root * settings.clip / client.expected_batch, root * 2 * settings.clip

    def account_shape(self, settings: PrivacyConfig, client: ClientShape) -> tuple[float, int]:
        """(sampling rate, releases per round) of this mechanism for a record of ``client``."""
        return (1.0, 1) if self.per_participation else (client.sampling_rate(settings), client.steps)


@dataclass(frozen=True)
class ClientShape:
    """What a privacy plan needs to know of one client."""

    n_train: int
    batch_size: int  # the configured B
    steps: int  # local steps per round

    @property
    def expected_batch(self) -> int:
        return min(self.batch_size, self.n_train)

    def sampling_rate(self, settings: PrivacyConfig) -> float:
        if settings.sampling != "poisson" or self.n_train <= self.batch_size:
            return 1.0
        return self.batch_size / self.n_train


@functools.lru_cache(maxsize=1024)
def local_plan(settings: PrivacyConfig, local: LocalDP, client: ClientShape, rounds: int) -> MechanismPlan:
    """A client's local mechanism planned on its own, from the run config and its data size
    alone: the server plans with it, and the client recomputes it to check what it is sent."""
    if client.n_train < 1:
        raise BudgetError("a client with no training records cannot be planned")
    sensitivity, per_batch = local.sensitivity(settings, client)
    rate, per_round = local.account_shape(settings, client)
    plan = plan_gaussian(
        settings,
        local.name,
        local.where,
        "client",
        sensitivity=sensitivity,
        releases=rounds * per_round,
        sampling_rate=rate,
        per_batch_sensitivity=per_batch,
        paper_sensitivity=sensitivity / math.sqrt(local.tensors),
    )
    if local.tensors > 1:
        plan.notes.append(
            f"{local.tensors} tensors are clipped to C separately and noised with the same sigma: "
            "accounted as one Gaussian release of joint sensitivity sqrt(n)*C/B"
        )
    if local.note:
        plan.notes.append(local.note)
    return plan


def required_local_sigma(
    settings: PrivacyConfig, local: LocalDP, client: ClientShape, rounds: int, received: float | None
) -> float:
    """Client side: the std of the local noise to draw. The server's value is accepted when it is
    at least what the client's own plan needs; a missing, non-positive or smaller value is
    refused (DP fails closed)."""
    need = local_plan(settings, local, client, rounds).sigma
    try:
        sigma = float(received)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        sigma = float("nan")
    if not sigma > 0 or not math.isfinite(sigma):
        raise NoiseRefused(
            f"privacy is on but the server sent no usable local noise level ({LOCAL_SIGMA} = "
            f"{received!r}); refusing to train without noise"
        )
    if sigma < need * (1 - 1e-9):
        raise NoiseRefused(
            f"the server asked for local noise sigma = {sigma:.6g}, below the {need:.6g} this node's own plan needs "
            f"for {local.name} (epsilon {settings.epsilon}, delta {settings.delta}, clip {settings.clip}, "
            f"{rounds} rounds x {client.steps} steps, batch {client.expected_batch} of {client.n_train} records); "
            "refusing to train"
        )
    return sigma


@dataclass(frozen=True)
class RecordAccount:
    """What each round a client trains costs one of its records."""

    sampling_rate: float
    steps: int
    z_local: float | None  # None: no local mechanism
    z_global: float | None  # None: no global mechanism, or the clients draw it (zcdp)
    zcdp: tuple[float, float] | None = None  # the distributed global release's (rho, xi) per round

    @property
    def shared_batch(self) -> bool:
        """One local step per round: the local and global gradients come from one batch."""
        return self.z_local is not None and self.z_global is not None and self.steps == 1

    def releases(self, rounds: int) -> list[Releases]:
        if self.shared_batch:
            assert self.z_local is not None and self.z_global is not None  # shared_batch: both set
            return [GaussianReleases(joint_noise_multiplier(self.z_local, self.z_global), rounds, self.sampling_rate)]
        out: list[Releases] = []
        if self.z_local is not None:
            out.append(GaussianReleases(self.z_local, rounds * self.steps, self.sampling_rate))
        if self.z_global is not None:
            # several local steps: the record may sit in any of them, so no amplification
            out.append(GaussianReleases(self.z_global, rounds, 1.0 if self.z_local is not None else self.sampling_rate))
        if self.zcdp is not None:  # the clients' distributed release: no amplification claimed
            out.append(ZCDpReleases(*self.zcdp, rounds))
        return out

    def epsilon(self, rounds: int, delta: float, accountant: str) -> float:
        return epsilon_spent(self.releases(rounds), delta, accountant)

    def as_dict(self) -> dict:
        d = {
            "sampling_rate": self.sampling_rate,
            "steps_per_round": self.steps,
            "z_local": self.z_local,
            "z_global": self.z_global,
            "shared_batch": self.shared_batch,
        }
        if self.zcdp is not None:
            d["zcdp_rho"], d["zcdp_xi"] = self.zcdp
        if self.shared_batch:
            assert self.z_local is not None and self.z_global is not None  # shared_batch: both set
            d["z_joint"] = joint_noise_multiplier(self.z_local, self.z_global)
        return d


def record_account(
    settings: PrivacyConfig,
    local: LocalDP | None,
    shape: ClientShape,
    sigma_local: float | None,
    z_global: float | None = None,
    zcdp: tuple[float, float] | None = None,
) -> RecordAccount:
    """What a round costs a record of a client of ``shape``: its local mechanism at
    ``sigma_local`` (None: none), with the server's Gaussian (``z_global``) or the clients'
    distributed release (``zcdp``). The one composition: the planner's ledger and a node's own
    check of its noise share (``client_app.secure_aggregation.check_share``) both read it."""
    z_local = None
    rate, steps = shape.sampling_rate(settings), shape.steps
    if sigma_local is not None:
        assert local is not None  # a local sigma exists only with a local mechanism
        z_local = sigma_local / valid_sensitivity(settings, *local.sensitivity(settings, shape))
        rate, steps = local.account_shape(settings, shape)
    return RecordAccount(rate, steps, z_local, z_global, zcdp)


@dataclass(frozen=True)
class GlobalDP:
    """A method's server-side mechanism: noise on the average of the sampled clients' clipped
    gradients (the reply tensors ``tensors``), once per round, divided by ``denominator``
    (frozen at planning)."""

    name: str
    where: str
    denominator: int
    tensors: tuple[str, ...] = ()
    note: str = ""  # what the ledger must say about who sees what (e.g. a trusted server)
    distributed: Distributed | None = None  # under secure aggregation: the clients draw it


@dataclass(frozen=True)
class Distributed:
    """The global mechanism drawn by the clients under secure aggregation (``privacy.distributed``):
    over ``dim`` coordinates, its noise planned for ``n_min`` survivors, rounding allowed to add
    ``rounding_overhead`` to the smallest per-record sensitivity, the sum modulo 2^``bits``."""

    dim: int
    n_min: int
    rounding_overhead: float
    bits: int


class PrivacyPlanner:
    """Plans every mechanism of a run (before round 1, and for a node that joins later), writes
    the plans into the ledger and answers what each client's records have spent."""

    def __init__(
        self,
        settings: PrivacyConfig,
        ledger: PrivacyLedger,
        rounds: int,
        local: LocalDP | None,
        global_dp: GlobalDP | None = None,
    ):
        self.settings = settings
        self.ledger = ledger
        self.rounds = rounds
        self.local = local
        self.global_dp = global_dp
        self.clients: dict[str, ClientShape] = {}
        self.local_plans: dict[str, MechanismPlan] = {}
        self.global_plan: MechanismPlan | None = None
        self.scale = 1.0  # the joint calibration's common factor c on every noise level
        # the global mechanism as the clients draw it under secure aggregation (None: the server does)
        self.distributed: DistributedGaussian | None = None
        self.gamma = 0.0  # its quantisation step, fixed at planning

    # ---- planning --------------------------------------------------------------------------
    def plan(self, clients: dict[str, ClientShape]) -> None:
        """Plan every mechanism for the nodes known before round 1."""
        s = self.settings
        self.clients = dict(clients)
        base = (
            {name: local_plan(s, self.local, shape, self.rounds) for name, shape in clients.items()}
            if self.local
            else {}
        )
        if self.global_dp is not None:
            self.global_plan = self._plan_global()
        distributed = self.global_dp is not None and self.global_dp.distributed is not None
        if (
            self.global_dp is not None
            and (self.local is not None or distributed)
            and s.calibration == "accountant"
            and not s.fixed_noise
        ):
            # Every mechanism alone meets the target; together they would not (nor does the clients'
            # distributed share, calibrated as a Gaussian, with its rounding and no amplification).
            # Scale all noise by one factor until the worst client's composed epsilon does.
            global_plan = self.global_plan
            assert global_plan is not None  # planned just above: global_dp is set

            def worst(c: float) -> float:
                return max(
                    self._account(shape, base[name].sigma * c if name in base else None, global_plan.sigma * c).epsilon(
                        self.rounds, s.delta, s.accountant
                    )
                    for name, shape in clients.items()
                )

            self.scale = smallest_scale(worst, s.epsilon)
            self.global_plan = global_plan.scaled(self.scale)
            self.ledger.notes.append(
                f"local and global noise calibrated jointly: each mechanism's sigma, calibrated alone to epsilon = "
                f"{s.epsilon}, is multiplied by {self.scale:.4f} so that the composition a record of every client "
                "undergoes (its local steps and its share of the global release) meets the target"
            )
        for name, plan in base.items():
            self._set_local(name, plan.scaled(self.scale))
        if self.global_plan is not None:
            self.ledger.add_plan(self.global_plan)
            self.distributed = self._shares(self.global_plan)
        for name in clients:
            self._record(name)

    def admit(self, name: str, shape: ClientShape) -> None:
        """Plan a node that joined after round 1's plan: its local noise is calibrated so that
        its composed epsilon, with the global noise already fixed, meets the target. Raises
        ``BudgetError`` (the node must be excluded) if no local noise can."""
        if name in self.clients:
            return
        s = self.settings
        plan = local_plan(s, self.local, shape, self.rounds) if self.local else None
        if (
            self.global_plan is not None
            and self.local is not None
            and s.calibration == "accountant"
            and not s.fixed_noise
        ):
            alone = self._account(shape, None, self.global_plan.sigma).epsilon(self.rounds, s.delta, s.accountant)
            if alone > s.epsilon * (1 + 1e-9):
                raise BudgetError(
                    "it joined after the privacy plan was made and its records would spend "
                    f"epsilon = {alone:.4g} in the "
                    f"global mechanism alone ({shape.n_train} records, batch {shape.expected_batch}), above "
                    f"privacy.epsilon = {s.epsilon}: start every node before the run, or give it more data"
                )
            assert plan is not None  # self.local is set
            sigma_local, sigma_global = plan.sigma, self.global_plan.sigma
            c = smallest_scale(
                lambda c: self._account(shape, sigma_local * c, sigma_global).epsilon(
                    self.rounds, s.delta, s.accountant
                ),
                s.epsilon,
            )
            plan = plan.scaled(c)
        cap = s.max_epsilon
        if cap and not s.fixed_noise:
            planned = self._account(
                shape, plan.sigma if plan else None, self.global_plan.sigma if self.global_plan else None
            )
            eps = planned.epsilon(self.rounds, s.delta, s.accountant)
            if eps > cap * (1 + 1e-9):
                raise BudgetError(
                    f"it joined after the privacy plan was made and its records would spend epsilon = "
                    f"{eps:.4g}, above privacy.max-epsilon = {cap}"
                )
        self.clients[name] = shape
        if plan is not None:
            self._set_local(name, plan)
        self._record(name)

    def _plan_global(self) -> MechanismPlan:
        s, g = self.settings, self.global_dp
        assert g is not None  # only called when the method has a global mechanism
        b = min(shape.expected_batch for shape in self.clients.values())
        one_step = all(shape.steps == 1 for shape in self.clients.values())
        q = max(shape.sampling_rate(s) for shape in self.clients.values())
        d = g.distributed
        plan = plan_gaussian(
            s,
            g.name,
            g.where if d is None else f"{g.where}, drawn by the clients in shares under secure aggregation",
            "server" if d is None else "clients",
            sensitivity=s.clip / (g.denominator * b),
            releases=self.rounds,
            sampling_rate=q if one_step and d is None else 1.0,
            per_batch_sensitivity=2 * s.clip / g.denominator,
        )
        if d is not None:
            self._distribute(plan, d, g.denominator)
        elif not one_step:
            plan.notes.append("several local steps per round: no subsampling amplification is claimed")
        plan.notes.append(
            f"the average is always divided by at least {g.denominator} (the clients sampled at "
            "planning), also in rounds where fewer are sampled, so the sensitivity stays as planned"
        )
        return plan

    def _distribute(self, plan: MechanismPlan, d: Distributed, denominator: int) -> None:
        """Make ``plan`` the clients' distributed discrete Gaussian (``privacy.distributed``): the
        quantisation step gamma puts the rounding's sqrt(dim) at ``rounding_overhead`` of the
        smallest per-record sensitivity of a client's upload."""
        s = self.settings
        smallest = min(
            valid_sensitivity(s, s.clip / shape.expected_batch, 2 * s.clip) for shape in self.clients.values()
        )
        self.gamma = granularity(smallest, d.dim, d.rounding_overhead)
        plan.distributed = {
            "gamma": self.gamma,
            "denominator": denominator,
            "n_min": d.n_min,
            "dim": d.dim,
            "norm_bound": s.clip,
            "bits": d.bits,
        }
        plan.notes += [
            "distributed discrete Gaussian (Kairouz, Liu and Steinke 2021): each client adds its share in the "
            f"integers after rounding its upload at step gamma = {self.gamma:.4g}; a sum of at least n_min = "
            f"{d.n_min} shares (the secure aggregation's threshold) carries sigma; accounted as (xi, rho)-zCDP at "
            "the rounded sensitivity s/gamma + sqrt(dim), with no subsampling amplification",
        ]
        self._shares(plan)  # refused here if the shares cannot be drawn or the sum could wrap
        plan.planned_epsilon = plan.epsilon_after(plan.releases)

    def _shares(self, plan: MechanismPlan) -> DistributedGaussian | None:
        """The clients' shares of ``plan`` (None: the server draws it), checked: each share at
        least one quantisation step, and a sum of the denominator's clients that wraps around
        modulo 2^bits with probability at most ``WRAP_PROBABILITY``."""
        try:
            noise = plan.noise()
        except ValueError as why:
            raise BudgetError(f"{why}: lower secure-aggregation.rounding-overhead") from None
        if noise is None or plan.distributed is None:
            return None
        clients = plan.distributed["denominator"]
        p = noise.wrap_probability(clients)
        if p > WRAP_PROBABILITY:
            raise BudgetError(
                f"a sum of {clients} noisy uploads could wrap around modulo 2^{noise.bits} with probability up to "
                f"{p:.2g} (at most {WRAP_PROBABILITY:g} allowed): raise secure-aggregation.bits"
            )
        return noise

    def _set_local(self, name: str, plan: MechanismPlan) -> None:
        self.local_plans[name] = plan
        self.ledger.add_plan(plan, client=name)

    def _record(self, name: str) -> None:
        acc = self.account(name)
        self.ledger.records[name] = {
            **acc.as_dict(),
            "planned_epsilon": acc.epsilon(self.rounds, self.settings.delta, self.settings.accountant),
        }

    # ---- accounting ------------------------------------------------------------------------
    def _account(self, shape: ClientShape, sigma_local: float | None, sigma_global: float | None) -> RecordAccount:
        s = self.settings
        z_global = zcdp = None
        if sigma_global is not None:
            assert self.global_dp is not None  # a global sigma exists only with a global mechanism
            n, d = self.global_dp.denominator, self.global_dp.distributed
            if d is None:
                z_global = sigma_global / valid_sensitivity(s, s.clip / (n * shape.expected_batch), 2 * s.clip / n)
            else:  # the clients' shares: the record's upload moves by its sensitivity, rounded
                shares = DistributedGaussian.for_mean(sigma_global, self.gamma, n, d.n_min, d.dim, s.clip, d.bits)
                zcdp = shares.zcdp(valid_sensitivity(s, s.clip / shape.expected_batch, 2 * s.clip))
        return record_account(s, self.local, shape, sigma_local, z_global, zcdp)

    def account(self, name: str) -> RecordAccount:
        plan = self.local_plans.get(name)
        return self._account(
            self.clients[name], plan.sigma if plan else None, self.global_plan.sigma if self.global_plan else None
        )

    def local_sigma(self, name: str) -> float:
        return self.local_plans[name].sigma

    def epsilon(self, name: str, rounds: int) -> float:
        """What a record of client ``name`` has spent after it trained in ``rounds`` rounds."""
        return self.account(name).epsilon(rounds, self.settings.delta, self.settings.accountant)

    def worst_planned(self) -> float:
        return max((r["planned_epsilon"] for r in self.ledger.records.values()), default=0.0)


def client_plan(
    cfg: RunConfig, local_dp: Callable[[RunConfig], LocalDP] | None, n_train: int, instruction: TrainInstruction
) -> tuple[ClientShape, float]:
    """What a client executes this round: the server's plan (steps, batch size) and the std of its
    local-DP noise (0 without privacy) under its method's mechanism (``MethodSpec.local_dp``).
    Refused when the plan is missing, was made for another record count than this node holds, or
    carries less noise than the node's own plan for that shape needs (``required_local_sigma``);
    with privacy on and no mechanism, refused rather than trained without noise."""
    if instruction.local_steps < 1 or instruction.batch_size < 1:
        raise NoiseRefused(
            f"the server's train message carries no plan ({LOCAL_STEPS} = {instruction.local_steps}, "
            f"batch size {instruction.batch_size}); refusing to guess how much to train"
        )
    if instruction.num_train != n_train:
        raise NoiseRefused(
            f"the server planned this round for {instruction.num_train} training records ({NUM_TRAIN}) "
            f"but this node holds {n_train}: its handshake is stale; restart the run so that the "
            "server plans with this node's data"
        )
    shape = ClientShape(n_train, instruction.batch_size, instruction.local_steps)
    settings = cfg.privacy
    if not settings.enabled:
        return shape, 0.0
    if local_dp is None:
        raise NoiseRefused("privacy is on but this method has no local-DP mechanism; refusing to train without noise")
    return shape, required_local_sigma(settings, local_dp(cfg), shape, cfg.num_server_rounds, instruction.local_sigma)
