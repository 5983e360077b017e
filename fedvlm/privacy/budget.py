"""A run's privacy on the server: the plan of every mechanism, what each client's records have
spent so far, the budget stop, and where the noise comes from, all written to the ledger.

The strategy owns one ``RunBudget`` when privacy is on, and a ``NoBudget`` when it is off (the
same questions, answered for a run without noise: nothing planned, spent or recorded), so that no
caller asks which one it holds. The planner (``privacy.planner``) does
the calibration and the per-record composition, this module keeps the run's state around it:
which nodes are planned, how many rounds each has been sent, and the ledger entries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from fedvlm.privacy.accountants import ACCOUNTANTS
from fedvlm.privacy.accounting import BudgetError, check_delta
from fedvlm.privacy.distributed import DistributedGaussian
from fedvlm.privacy.ledger import PrivacyLedger
from fedvlm.privacy.mechanisms import NOISE_SOURCES, gaussian_noise, noise_generator
from fedvlm.privacy.noise_check import check_noise
from fedvlm.privacy.planner import ClientShape, GlobalDP, LocalDP, PrivacyPlanner
from fedvlm.runconfig.schema import PrivacyConfig

SEEDED_NOTE = (
    "seeded noise (privacy.noise-source): derived from the run seed, so anyone who knows the run config can "
    "regenerate and remove it; the epsilon holds only against parties without the config. Use "
    "noise-source=os for real data"
)


class RunBudget:
    """A run's privacy on the server (the module docstring); built by ``planned``."""

    def __init__(self, planner: PrivacyPlanner):
        noise_choice = planner.settings.noise_source  # the run config's privacy.noise-source
        if noise_choice not in (*NOISE_SOURCES, "auto"):
            raise ValueError(f"privacy.noise-source = {noise_choice!r} is not one of auto, {', '.join(NOISE_SOURCES)}")
        self.planner = planner
        self.settings, self.ledger, self.rounds = planner.settings, planner.ledger, planner.rounds
        self.noise_choice = noise_choice
        self.rounds_trained: dict[str, int] = {}  # node name -> rounds it was sent a train message
        # node name -> its own latest account of its records' epsilon, by accountant (the figures a
        # reprogramming node reports from its ledger with Opacus), set beside the server's figures
        self.node_accounts: dict[str, dict[str, float]] = {}
        # kept current as rounds are charged (``_refresh``): what a record of each planned client
        # has spent, by mechanism alone, and by every accountant (once a node reports its own)
        self.spent: dict[str, float] = {}
        self.components: dict[str, dict[str, float]] = {}
        self.accountants: dict[str, dict[str, float]] = {}
        self._changed: set[str] = set()  # clients whose figures changed since the last ledger entry
        self._reported: set[str] = set()  # nodes that reported their own account since then

    @classmethod
    def planned(
        cls,
        settings: PrivacyConfig,
        ledger: PrivacyLedger,
        rounds: int,
        local: LocalDP | None,
        global_dp: GlobalDP | None,
        shapes: Mapping[str, ClientShape],
        sources: Mapping[str, str],
        saved: Mapping | None = None,
    ) -> RunBudget:
        """The run's budget, every mechanism planned for the nodes known now (``shapes``: each
        one's local training; ``sources``: where each draws its noise), or, resuming, for the
        clients the interrupted run planned for (``saved``: its ``state_dict()['plan']``, with the
        global average's denominator it was planned with): a node not connected any more is
        simply not sampled, one that joined since is admitted late."""
        if saved is not None:
            shapes = {name: ClientShape(*shape) for name, shape in saved["clients"].items()}
            sources = {**saved["sources"], **{k: v for k, v in sources.items() if k in shapes}}
            if global_dp is not None:
                global_dp = dataclasses.replace(global_dp, denominator=int(saved["denominator"]))
        budget = cls(PrivacyPlanner(settings, ledger, rounds, local, global_dp))
        budget.plan(shapes, sources)
        return budget

    # ---- planning -------------------------------------------------------------------------
    def _check_sources(self, sources: Mapping[str, str]) -> None:
        if self.planner.global_dp is not None and self.noise_choice == "seeded":
            secret = sorted(name for name, src in sources.items() if src == "os")
            if secret:
                raise BudgetError(
                    f"privacy.noise-source = 'seeded' makes the server's global noise regenerable by anyone with the "
                    f"run config, while {', '.join(secret[:4])} draw their own noise from the OS (real data): "
                    "use privacy.noise-source = 'auto' or 'os'"
                )

    def plan(self, shapes: Mapping[str, ClientShape], sources: Mapping[str, str]) -> None:
        """Plan every mechanism for the nodes known before round 1 (``sources``: each node's
        noise source) and refuse a schedule past ``privacy.max-epsilon``."""
        self._check_sources(sources)
        fix = "lower privacy.delta"
        if self.settings.audit_canaries:  # each canary is a training record of the audited node
            fix = f"use fewer privacy.audit-canaries ({self.settings.audit_canaries} now, each a record) or {fix}"
        check_delta(self.settings.delta, sum(s.n_train for s in shapes.values()), "the federation's", fix)
        self.planner.plan(dict(shapes))
        self._refresh_all()
        self.record_noise_sources(sources)
        if self.planner.global_dp is not None and self.planner.global_dp.note:
            self.ledger.notes.append(self.planner.global_dp.note)
        cap = self.settings.max_epsilon
        if self.settings.fixed_noise or not cap:  # a budget-limited run stops when the cap is reached
            return
        planned = self.planner.worst_planned()
        if planned > cap * (1 + 1e-9):
            raise BudgetError(
                f"the privacy plan would spend epsilon = {planned:.4g} per record over {self.rounds} rounds, above "
                f"privacy.max-epsilon = {cap}; lower num-server-rounds or prompt.local-steps, raise "
                f"privacy.max-epsilon, or use privacy.calibration='accountant' with privacy.epsilon <= {cap}"
            )

    def admit(self, name: str, shape: ClientShape, source: str) -> None:
        """Plan a node that joined after round 1's plan; ``BudgetError`` if it cannot be covered."""
        if name in self.planner.clients:
            return
        if self.planner.global_dp is not None and self.noise_choice == "seeded" and source == "os":
            raise BudgetError(
                "it draws OS noise but privacy.noise-source = 'seeded' makes the server's global noise regenerable"
            )
        records = sum(s.n_train for s in self.planner.clients.values()) + shape.n_train
        check_delta(
            self.settings.delta,
            records,
            "the federation's",
            "it joined after the plan and would bring the run past the delta it was planned with; lower privacy.delta",
        )
        self.planner.admit(name, shape)
        self._refresh([name])

    def is_planned(self, name: str) -> bool:
        return name in self.planner.clients

    # ---- spending: every charge is one of the three below ------------------------------------
    def charge_round(self, names: Iterable[str]) -> float | None:
        """A round's train messages to ``names``, about to be sent: one round spent for each
        (when sent, since a lost reply may still have been computed), unless that would take a
        record past privacy.max-epsilon: then nothing is spent, and that epsilon is returned
        (the run stops before the round)."""
        names = list(names)
        over = self.would_exceed(names)
        if over is None:
            self._spend(names)
        return over

    def charge_replay(self, name: str, server_round: int, sources: Mapping[str, str]) -> tuple[bool, float | None]:
        """Node ``name`` asked again for round ``server_round``'s training: (whether its round was
        spent again, the epsilon that forbids asking). Spent where the copy is a second,
        independent release (``replay_is_fresh``), and refused where that, with every round still
        to come, would take its records past what the run promised (``beyond_promise``)."""
        if not self.replay_is_fresh([name], sources):
            return False, None
        over = self.beyond_promise([name], 1 + self.rounds - server_round)
        if over is not None:
            return False, over
        self._spend([name])
        return True, None

    def _spend(self, names: Iterable[str]) -> None:
        names = list(names)
        for name in names:
            self.rounds_trained[name] = self.rounds_trained.get(name, 0) + 1
        self._refresh(names)

    def _refresh(self, names: Iterable[str], changed: bool = True) -> None:
        """What a record of each of ``names`` has spent, recomputed after its rounds changed. The
        per-client figures are kept current here, so that a round costs one accountant call per
        client it charged, not one per client the run knows (a thousand-node federation samples
        a few). ``changed``: the next ledger entry states them (they spent since the last one)."""
        planner = self.planner
        for name in names:
            if name not in planner.clients:
                continue
            rounds = self.rounds_trained.get(name, 0)
            self.spent[name] = planner.epsilon(name, rounds)
            plan = planner.local_plans.get(name)
            if plan is not None:  # each mechanism on its own, as papers that report them separately do
                steps = planner.clients[name].steps
                self.components.setdefault(plan.name, {})[name] = plan.epsilon_after(rounds * steps)
            if self.node_accounts:
                self.accountants[name] = self._accountants(name)
            if changed:
                self._changed.add(name)

    def _refresh_all(self) -> None:
        """Every planned client's figures from the rounds counted (a new plan, a resumed run): the
        ledger's ``spent`` states them; its entries state what changes from here."""
        self.spent, self.components, self.accountants = {}, {}, {}
        self._refresh(sorted(self.planner.clients), changed=False)

    def worst(self, extra: Mapping[str, int]) -> float:
        """The most a record of any client will have spent after ``extra`` more rounds of the
        clients it names (the others as they stand)."""
        planner = self.planner
        worst = max((v for n, v in self.spent.items() if n not in extra), default=0.0)
        for name, more in extra.items():
            if name in planner.clients:
                worst = max(worst, planner.epsilon(name, self.rounds_trained.get(name, 0) + more))
        return worst

    def _accountants(self, name: str) -> dict[str, float]:
        """Node ``name``'s epsilon so far by each registered accountant."""
        account = self.planner.account(name)
        rounds = self.rounds_trained.get(name, 0)
        return {acc: account.epsilon(rounds, self.settings.delta, acc) for acc in ACCOUNTANTS}

    def entry(self) -> dict:
        """The ledger's entry for the rounds counted since the previous one: the run-wide figures
        (the most, least and mean epsilon a record of a planned client has spent) and, per
        client, only the clients whose records spent since the previous entry (``changed``; the
        ledger's ``spent`` holds every client's figure once, ``current``). Each figure is what a
        record has spent, every mechanism it feeds composed."""
        values = np.fromiter(self.spent.values(), dtype=np.float64, count=len(self.spent))
        changed = sorted(self._changed)
        components: dict = {mech: {n: per[n] for n in changed if n in per} for mech, per in self.components.items()}
        if self.planner.global_plan is not None:
            components[self.planner.global_plan.name] = self._global_component()
        out: dict = {
            "epsilon": float(values.max()) if len(values) else 0.0,
            "epsilon_mean": float(values.mean()) if len(values) else 0.0,
            "epsilon_min": float(values.min()) if len(values) else 0.0,
            "changed": {n: self.spent[n] for n in changed},
            "components": components,
        }
        if self.node_accounts:  # the nodes' own accounts, beside every accountant's figure for the same rounds
            out["by_accountant"] = {n: self.accountants[n] for n in changed if n in self.accountants}
            out["client_reported"] = {n: dict(self.node_accounts[n]) for n in sorted(self._reported)}
        self._changed.clear()
        self._reported.clear()
        return out

    def _global_component(self) -> float:
        g = self.planner.global_plan
        assert g is not None  # asked only with a global mechanism
        return g.epsilon_after(max(self.rounds_trained.values(), default=0))

    def current(self) -> dict:
        """What a record of every planned client has spent as the rounds stand, composed
        (``spent``) and by mechanism alone (``spent_components``); with the nodes' own accounts,
        every accountant's figure beside each node's."""
        components: dict = dict(self.components)
        if self.planner.global_plan is not None:
            components[self.planner.global_plan.name] = self._global_component()
        out: dict = {"spent": dict(sorted(self.spent.items())), "spent_components": components}
        if self.node_accounts:
            out["by_accountant"] = dict(sorted(self.accountants.items()))
            out["client_reported"] = dict(sorted(self.node_accounts.items()))  # each replaced when reported anew
        return out

    def note_node_account(self, name: str, figures: Mapping[str, float]) -> None:
        """What node ``name`` reports its records have spent, by accountant (its latest reply)."""
        first = not self.node_accounts
        self.node_accounts[name] = {k: float(v) for k, v in figures.items()}
        self._reported.add(name)
        if first:  # from now on every accountant's figure is kept beside the nodes' (``_refresh``)
            self.accountants = {n: self._accountants(n) for n in sorted(self.planner.clients)}

    def would_exceed(self, names: Iterable[str]) -> float | None:
        """The worst per-record epsilon a round training ``names`` would bring, if it crosses
        max-epsilon."""
        cap = self.settings.max_epsilon
        names = list(names)
        if not (cap and names):
            return None
        worst = self.worst({n: 1 for n in names})
        return worst if worst > cap * (1 + 1e-9) else None

    def beyond_promise(self, names: Iterable[str], rounds: int) -> float | None:
        """The worst per-record epsilon ``rounds`` more rounds of ``names`` would bring, if it
        crosses what the run promised: privacy.max-epsilon, else the target privacy.epsilon (a
        run with a fixed noise multiplier promises no epsilon in advance)."""
        promise = self.settings.max_epsilon or (0.0 if self.settings.fixed_noise else self.settings.epsilon)
        names = list(names)
        if not (promise and names):
            return None
        worst = self.worst({n: rounds for n in names})
        return worst if worst > promise * (1 + 1e-9) else None

    # ---- what the strategies and the loop read of the plan ---------------------------------
    def local_sigma(self, name: str) -> float | None:
        """The std of node ``name``'s local-DP noise (None: the method has no local mechanism)."""
        return self.planner.local_sigma(name) if self.planner.local is not None else None

    def noised_tensors(self) -> tuple[str, ...]:
        """The reply tensors the server noises (its mechanism's), whose bound must not depend on
        the data (``strategies.reply_bound.reply_bounds``)."""
        return self.planner.global_dp.tensors if self.planner.global_dp is not None else ()

    def global_denominator(self) -> int | None:
        """What the server's average is divided by at least (None: no server mechanism)."""
        return self.planner.global_dp.denominator if self.planner.global_dp is not None else None

    def release_global(
        self, mean: torch.Tensor, key: list[int], sources: Mapping[str, str]
    ) -> tuple[torch.Tensor, float]:
        """The server's release: ``mean`` (the bounded uploads over ``global_denominator``) plus
        its planned Gaussian noise, drawn from the server's noise source (``key``: the round's
        seeded stream, used only when that source is 'seeded'); with the noise's std. The added
        noise passes the same check as a node's private step (``dpsgd.check_noise``), or nothing
        is released (``MechanismError``: the run fails closed)."""
        plan = self.planner.global_plan
        if plan is None:
            raise BudgetError("this run planned no server-side mechanism: nothing to release")
        noise = gaussian_noise(mean.shape, plan.sigma, noise_generator(self.server_noise_source(sources), key))
        released = mean + noise
        # the server's release is checked as every private step is, before it leaves
        check_noise({"the global prompt gradient": released - mean}, plan.sigma, "the server's release")
        return released, plan.sigma

    def distributed_noise(self) -> DistributedGaussian | None:
        """The global mechanism's noise as the clients add it under secure aggregation (None: the
        run has no global mechanism, or the server adds its noise itself)."""
        return self.planner.distributed

    def audit_inputs(self) -> tuple[LocalDP, str | None] | None:
        """What the one-run audit needs of the plan: the local mechanism, and the server's
        mechanism's name if there is one (None: no local mechanism to audit)."""
        if self.planner.local is None:
            return None
        return self.planner.local, self.planner.global_dp.name if self.planner.global_dp is not None else None

    # ---- state across rounds (strategies.base.FederatedStrategy.state_dict) -------------------
    def sigmas(self) -> dict[str, float]:
        """The noise level of every planned mechanism, by who draws it."""
        out = {f"client {name}": plan.sigma for name, plan in sorted(self.planner.local_plans.items())}
        if self.planner.global_plan is not None:
            out["server"] = self.planner.global_plan.sigma
        return out

    def state_dict(self) -> dict:
        """What was spent, the noise it was drawn with, and what the plan was made for (its
        clients and their shapes, the global denominator, the noise sources): a resumed run plans
        from these, whoever is connected when it resumes."""
        planner = self.planner
        plan = {
            "clients": {name: [s.n_train, s.batch_size, s.steps] for name, s in sorted(planner.clients.items())},
            "denominator": planner.global_dp.denominator if planner.global_dp is not None else 0,
            "sources": dict(self.ledger.noise_sources.get("clients", {})),
        }
        return {
            "rounds_trained": dict(self.rounds_trained),
            "node_accounts": {k: dict(v) for k, v in self.node_accounts.items()},
            "sigmas": self.sigmas(),
            "plan": plan,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue spending from ``state``; a plan that now draws other noise than the one the
        spent rounds were drawn with (other rounds with a target epsilon, other nodes) is refused."""
        now = self.sigmas()
        differ = [f"{k} {v:.6g} -> {now[k]:.6g}" for k, v in state["sigmas"].items() if k in now and now[k] != v]
        if differ:
            raise BudgetError(
                f"the privacy plan for this config draws other noise than the interrupted run did "
                f"({'; '.join(differ)}): the epsilon already spent was accounted for the old noise. Resume with the "
                "config it ran with (with privacy.epsilon, sigma depends on num-server-rounds: use "
                "privacy.noise-multiplier to extend a run)"
            )
        self.rounds_trained = {str(k): int(v) for k, v in state["rounds_trained"].items()}
        self.node_accounts = {str(k): dict(v) for k, v in state["node_accounts"].items()}
        self._refresh_all()

    # ---- noise sources ------------------------------------------------------------------------
    def server_noise_source(self, sources: Mapping[str, str]) -> str:
        """Randomness of the server's own noise: with 'auto', secret as soon as one node protects
        its own noise that way, since clients know the run seed and could otherwise regenerate
        the server's noise."""
        if self.noise_choice != "auto":
            return self.noise_choice
        return "os" if "os" in sources.values() else "seeded"

    def replay_is_fresh(self, names: Iterable[str], sources: Mapping[str, str]) -> bool:
        """Whether computing a round of ``names`` again (a message asked again, a resumed round)
        is a second, independent release: with OS noise at the server or at one of them. With
        seeded noise everywhere the same records, state and noise release the same tensors."""
        return self.server_noise_source(sources) == "os" or any(sources.get(n) == "os" for n in names)

    def record_noise_sources(self, sources: Mapping[str, str]) -> None:
        self.ledger.noise_sources = {
            "server": self.server_noise_source(sources),
            "clients": dict(sorted(sources.items())),
        }
        if (
            "seeded" in (self.ledger.noise_sources["server"], *sources.values())
            and SEEDED_NOTE not in self.ledger.notes
        ):
            self.ledger.notes.append(SEEDED_NOTE)

    def charge_abandoned(self, server_round: int, trainees: Iterable[str], sources: Mapping[str, str]) -> dict:
        """A resumed run's abandoned round ``server_round``, sent to ``trainees``: spent again where
        rerunning it is a second, independent release (``replay_is_fresh``); what was decided."""
        planned = [t for t in trainees if self.is_planned(t)]
        fresh = self.replay_is_fresh(planned, sources)
        if fresh:
            self._spend(planned)
        return {
            "abandoned_round": server_round,
            "charged": fresh,
            "why": "OS noise: the rerun round is a second, independent release"
            if fresh
            else "seeded noise: the rerun round releases the same tensors again",
        }

    # ---- what the run folder records -------------------------------------------------------
    def ledger_section(self) -> dict:
        """results.json's ``privacy`` section: the ledger as it stands, with what every planned
        client has spent so far (``current``)."""
        return self.ledger.as_dict() | self.current()

    def record_round(self, server_round: int, sources: Mapping[str, str]) -> dict:
        """Write round ``server_round``'s entry into the ledger (``sources``: the nodes' noise
        sources, some may have joined since); the entry (``entry``)."""
        entry = self.entry()
        self.record_noise_sources(sources)
        self.ledger.record_round(server_round, entry)
        return entry

    def check_resumable(self, state: dict | None) -> None:
        """``BudgetError`` unless a checkpoint's budget (None: privacy was off) can continue here."""
        if state is None:
            raise BudgetError("the checkpoint was made with privacy off, this run has it on")
        self.load_state_dict(state)


class NoBudget:
    """The budget of a run with privacy off: no mechanism, nothing spent, nothing to stop at or to
    record, every node admitted. Answers every question ``RunBudget`` does, so that the strategy
    and the loop never branch on privacy being on."""

    def is_planned(self, name: str) -> bool:
        return True  # nothing to plan: every node is admitted as it connects

    def admit(self, name: str, shape: ClientShape, source: str) -> None:
        """Nothing to plan (``is_planned`` says every node is)."""

    def charge_round(self, names: Iterable[str]) -> float | None:
        return None  # nothing is spent without a mechanism, and nothing stops the run

    def charge_replay(self, name: str, server_round: int, sources: Mapping[str, str]) -> tuple[bool, float | None]:
        return False, None  # a message asked again costs no privacy

    def local_sigma(self, name: str) -> float | None:
        return None

    def noised_tensors(self) -> tuple[str, ...]:
        return ()

    def global_denominator(self) -> int | None:
        return None

    def audit_inputs(self) -> tuple[LocalDP, str | None] | None:
        return None

    def release_global(self, mean: torch.Tensor, key: list[int], sources: Mapping[str, str]) -> None:
        return None  # no server mechanism: the server uses the mean as it is

    def distributed_noise(self) -> None:
        return None  # no mechanism: a secure sum carries no noise

    def note_node_account(self, name: str, figures: Mapping[str, float]) -> None:
        """A node's own account is a privacy figure: none is kept without privacy."""

    def charge_abandoned(self, server_round: int, trainees: Iterable[str], sources: Mapping[str, str]) -> dict:
        return {}  # nothing was spent, so nothing is charged again

    def current(self) -> dict:
        return {}  # nothing planned, so nothing spent

    def ledger_section(self) -> None:
        return None  # no ledger in results.json

    def record_round(self, server_round: int, sources: Mapping[str, str]) -> None:
        return None

    def state_dict(self) -> None:
        return None

    def check_resumable(self, state: dict | None) -> None:
        if state is not None:
            raise BudgetError("the checkpoint spent privacy, this run has privacy off: resume with its config")
