"""Privacy plans and the per-run privacy ledger.

A ``MechanismPlan`` fixes one Gaussian mechanism of a run before round 1: where the noise is
added, the clip norm, the sensitivity the calibration assumed and the one that is valid for
what the code does, σ, the noise multiplier z = σ/S, the number of releases, the sampling, δ,
how σ was calibrated, and the ε an accountant gives for exactly that noise. The planner
(``privacy.planner``) makes the plans and sends each client the σ it must draw with, so the
numbers in ``results.json`` are the numbers the noise was drawn with.

The ``PrivacyLedger`` is the ``privacy`` section of ``results.json``: the plans, each client's
per-record account, the ε a record of every client has spent after every round (all the
mechanisms it feeds composed, with each mechanism alone beside it), the values that leave nodes
outside every mechanism, and notes where a stated guarantee does not hold.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace

from fedvlm.privacy.accounting import (
    GaussianReleases,
    Releases,
    ZCDpReleases,
    calibrate_noise_multiplier,
    epsilon_spent,
    paper_sigma,
)
from fedvlm.privacy.distributed import DistributedGaussian
from fedvlm.runconfig.schema import PrivacyConfig


@dataclass
class MechanismPlan:
    name: str
    where: str
    party: str  # "client" (local DP) or "server" (global DP)
    clip: float
    clipping: str
    sensitivity: float  # L2 sensitivity of one release, as the calibration assumes
    sigma: float
    noise_multiplier: float
    releases: int
    sampling: str
    sampling_rate: float  # used by the accountant (1.0: no amplification claimed)
    delta: float
    calibration: str
    accountant: str
    target_epsilon: float
    planned_epsilon: float  # accountant's ε after all releases, for this σ
    true_sensitivity: float  # what one record can really change (privacy.ledger.valid_sensitivity)
    notes: list[str] = field(default_factory=list)
    # drawn by the clients under secure aggregation (privacy.distributed): the quantisation step
    # gamma of the sum, the denominator, n_min, dim, norm_bound and bits; None: one Gaussian draw
    distributed: dict | None = None

    def noise(self) -> DistributedGaussian | None:
        """The clients' discrete Gaussian shares of this mechanism (None: not distributed)."""
        d = self.distributed
        if d is None:
            return None
        return DistributedGaussian.for_mean(
            self.sigma, d["gamma"], d["denominator"], d["n_min"], d["dim"], d["norm_bound"], d["bits"]
        )

    def releases_obj(self, count: int) -> Releases:
        noise = self.noise()
        if noise is not None:  # the distributed discrete Gaussian's bound, at the true sensitivity
            assert self.distributed is not None  # noise() returned one
            return ZCDpReleases(*noise.zcdp(self.true_sensitivity * self.distributed["denominator"]), count)
        return GaussianReleases(self.sigma / self.true_sensitivity, count, self.sampling_rate)

    def epsilon_after(self, count: int) -> float:
        """ε an accountant gives after ``count`` releases with the true sensitivity."""
        return epsilon_spent(self.releases_obj(count), self.delta, self.accountant)

    def scaled(self, factor: float) -> MechanismPlan:
        """The same mechanism with ``factor`` times the noise (a joint calibration's scaling)."""
        if factor == 1.0:
            return self
        plan = replace(
            self,
            sigma=self.sigma * factor,
            noise_multiplier=self.noise_multiplier * factor,
            notes=[*self.notes, f"sigma scaled by {factor:.4f} in the joint calibration"],
        )
        plan.planned_epsilon = plan.epsilon_after(plan.releases)
        return plan

    def as_dict(self) -> dict:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, float) and math.isinf(v):
                d[k] = "inf"
        noise = self.noise()
        if noise is not None:
            d["distributed"] = {**d["distributed"], "client_sigma": noise.client_sigma}
        return d


def valid_sensitivity(settings: PrivacyConfig, sensitivity: float, per_batch_sensitivity: float) -> float:
    """What one record can really change in a release whose calibration assumed ``sensitivity``
    (add/remove one record, per-sample clipping, Poisson batches):
    - per-batch clipping: clipping the batch mean to C bounds a record's influence by 2C, not C/B;
    - fixed-size batches (the paper's calibration): adding a record displaces another from its
      batch, so the clipped sum moves by up to 2C: sensitivity 2C/B."""
    if settings.clipping == "per-batch":
        return per_batch_sensitivity
    if settings.sampling == "uniform":
        return 2 * sensitivity
    return sensitivity


def _sigma(
    s: PrivacyConfig, sensitivity: float, releases: int, q: float, paper_sensitivity: float | None
) -> tuple[float, list[str]]:
    """A mechanism's noise std under ``s``'s calibration, and the notes its plan carries about it."""
    notes: list[str] = []
    if s.sampling != "poisson":
        notes.append("fixed-size minibatches: the accountant claims no subsampling amplification")
    if s.fixed_noise:
        sigma = s.noise_multiplier * sensitivity
        notes.append("fixed noise multiplier (privacy.noise-multiplier): epsilon is reported, not targeted")
    elif s.calibration == "paper":
        sigma = paper_sigma(
            paper_sensitivity if paper_sensitivity is not None else sensitivity, releases, s.delta, s.epsilon
        )
        notes.append(
            "sigma from DP-FPL's closed form sigma = S*sqrt(T*ln(1/delta))/epsilon (constant 1); "
            "planned_epsilon is what an accountant gives for that sigma"
        )
    else:
        sigma = calibrate_noise_multiplier(s.epsilon, s.delta, releases, q, s.accountant) * sensitivity
    if s.clipping == "per-batch":
        # the public code's behaviour: the guarantee computed from C/B does not hold
        notes.append(
            "per-batch clipping: one record can move the clipped batch gradient by up to 2C, "
            "so the stated epsilon does NOT hold; planned_epsilon uses the true sensitivity"
        )
    elif s.sampling == "uniform":
        notes.append(
            "fixed-size batches: a record added to the data displaces another from its batch, so the "
            "valid sensitivity is twice the one sigma was calibrated for; planned_epsilon uses it"
        )
    return sigma, notes


def plan_gaussian(
    settings: PrivacyConfig,
    name: str,
    where: str,
    party: str,
    sensitivity: float,
    releases: int,
    sampling_rate: float,
    per_batch_sensitivity: float,
    paper_sensitivity: float | None = None,
) -> MechanismPlan:
    """Plan one mechanism.

    ``sensitivity``: L2 sensitivity of one release under per-sample clipping (what the
    calibration assumes); ``per_batch_sensitivity``: what one record can really change when
    the batch gradient is clipped as a whole instead; ``paper_sensitivity``: what the paper's
    closed form plugs in (DP-FPL's S_L = C/B, S_G = C/(N·B), per released tensor); defaults
    to ``sensitivity``.
    """
    s = settings
    q = sampling_rate if s.sampling == "poisson" else 1.0
    sigma, notes = _sigma(s, sensitivity, releases, q, paper_sensitivity)
    plan = MechanismPlan(
        name=name,
        where=where,
        party=party,
        clip=s.clip,
        clipping=s.clipping,
        sensitivity=sensitivity,
        sigma=float(sigma),
        noise_multiplier=float(sigma / sensitivity),
        releases=releases,
        sampling=s.sampling,
        sampling_rate=q,
        delta=s.delta,
        calibration="fixed-noise" if s.fixed_noise else s.calibration,
        accountant=s.accountant,
        target_epsilon=s.epsilon,
        planned_epsilon=0.0,
        true_sensitivity=valid_sensitivity(s, sensitivity, per_batch_sensitivity),
        notes=notes,
    )
    plan.planned_epsilon = plan.epsilon_after(releases)
    return plan


RELEASED_NOTE = (
    "These values leave every node un-noised, outside the accounted mechanisms, and the epsilon does not cover "
    "them: the handshake (data sizes, class ids, partition id, backbone fingerprint), and with every reply the "
    "number of examples, training loss and accuracy, evaluation metrics and timings (also stored per client in "
    "results.json rounds[].clients). They are aggregate statistics of a node's data, each computed from many "
    "records, but a single record can shift them; the server, and whoever reads the run folder, sees them. "
    "Against a curious server, treat them as released without protection."
)


class PrivacyLedger:
    def __init__(self, settings: PrivacyConfig, method: str):
        self.settings = settings
        self.method = method
        self.plans: dict[str, MechanismPlan] = {}
        self.client_plans: dict[str, dict[str, MechanismPlan]] = {}  # per-client LDP plans
        self._rendered: dict[str, tuple[tuple[MechanismPlan, ...], dict]] = {}  # _client_mechanisms
        # per client: what one round costs its records (privacy.planner.RecordAccount) and the
        # epsilon a record would spend if the client trained in every round
        self.records: dict[str, dict] = {}
        self.rounds: list[dict] = []
        self.notes: list[str] = []
        # where each party's DP randomness comes from ('seeded' | 'os', privacy.mechanisms)
        self.noise_sources: dict = {}
        # values that leave nodes outside every accounted mechanism, by message (note_released)
        self.released: dict[str, set[str]] = {}
        # how the server bounds each part of a reply before it uses it, and why that keeps the
        # sensitivity above (strategies.validation.ReplyBound)
        self.reply_bounds: list[dict] = []

    def add_plan(self, plan: MechanismPlan, client: str | None = None) -> None:
        if client is None:
            self.plans[plan.name] = plan
        else:
            self.client_plans.setdefault(client, {})[plan.name] = plan

    def _client_mechanisms(self, client: str) -> dict:
        """Client ``client``'s plans as results.json records them: the same object while its plans
        are the same (``utils.files.PartsKeptJson`` keeps its text)."""
        per = self.client_plans[client]
        held = self._rendered.get(client)
        plans = tuple(per.values())
        if held is None or len(held[0]) != len(plans) or any(a is not b for a, b in zip(held[0], plans, strict=True)):
            held = self._rendered[client] = (plans, {k: p.as_dict() for k, p in per.items()})
        return held[1]

    def note_released(self, message: str, keys) -> None:
        """Record the names of values a node sent outside the noised tensors."""
        self.released.setdefault(message, set()).update(str(k) for k in keys)

    def record_round(self, server_round: int, entry: dict) -> None:
        self.rounds.append({"round": server_round, **entry})

    def state_dict(self) -> dict:
        """What the rounds added (the plans and records are re-made from the config)."""
        released = {m: sorted(k) for m, k in self.released.items()}
        return {"rounds": self.rounds, "released": released, "notes": self.notes}

    def load_state_dict(self, state: dict) -> None:
        self.rounds = list(state["rounds"])
        for message, keys in state["released"].items():
            self.note_released(message, keys)
        self.notes += [n for n in state["notes"] if n not in self.notes]

    def as_dict(self) -> dict:
        s = self.settings
        return {
            "method": self.method,
            "enabled": s.enabled,
            "settings": asdict(s),
            "mechanisms": {k: p.as_dict() for k, p in self.plans.items()},
            "client_mechanisms": {c: self._client_mechanisms(c) for c in self.client_plans},
            "records": self.records,
            "noise_sources": self.noise_sources,
            "reply_bounds": self.reply_bounds,
            "rounds": self.rounds,
            "released_outside_mechanisms": {
                "values": {m: sorted(keys) for m, keys in sorted(self.released.items())},
                "note": RELEASED_NOTE,
            },
            "notes": self.notes,
        }


# ---- reading a ledger back (results.json's ``privacy`` section) ------------------------------
# A round's entry names only the clients whose records spent since the entry before (``changed``);
# an earlier fedvlm wrote every planned client into every entry (``per_client``), which grows with
# clients x rounds. Both are read here, so a run folder of either plots and tabulates.


def round_changes(entry: dict) -> dict[str, float]:
    """The clients whose figure this entry states, with the epsilon a record of each has spent."""
    return entry.get("changed", entry.get("per_client")) or {}


def round_spread(entry: dict) -> tuple[float, float, float]:
    """(least, mean, most) epsilon spent by a record of a planned client after this entry's round."""
    if "epsilon_min" in entry:
        return entry["epsilon_min"], entry["epsilon_mean"], entry["epsilon"]
    values = list((entry.get("per_client") or {"-": entry["epsilon"]}).values())
    return min(values), sum(values) / len(values), max(values)


def spent_after_rounds(section: dict) -> Iterator[tuple[int, dict[str, float]]]:
    """(round, what a record of each client stated so far has spent after it), round by round:
    one running map, updated in place (copy it to keep a round's)."""
    spent: dict[str, float] = {}
    for entry in section.get("rounds") or []:
        spent.update(round_changes(entry))
        yield entry["round"], spent


def final_spent(section: dict) -> dict[str, float]:
    """What a record of every planned client has spent after the last round."""
    if "spent" in section:
        return dict(section["spent"])
    last: dict[str, float] = {}
    for _, spent in spent_after_rounds(section):
        last = spent
    return dict(last)
