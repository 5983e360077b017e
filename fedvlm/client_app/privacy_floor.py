"""A node's ledger of what it released, and its own privacy floor.

The ledger. Every node that trains under a local mechanism covering what it uploads keeps one
ledger of its releases: per release the run, the round, the noise multiplier, the steps, the
sampling rate, its noise source and the epsilon its records had spent after it. A node whose node
config names a ``state-dir`` keeps it on its own disk, one file per node and data
(``state-dir/ledgers/``: an organisation's folder is one data set whichever node name trains on
it; a partition node's data is its own), composed across every run that touched those records:
new runs, resumed runs, reruns and runs whose folder the server wiped alike. Nothing the server
sends names or chooses that file. It is written atomically (a temporary file, fsynced, renamed)
under an exclusive lock, so two runs on one node cannot both spend the same remaining budget. A
node without a ``state-dir`` (a simulated one) keeps the ledger of the run in its private state
(``client_app.state``), as the run's account of its releases. A reprogramming node's Opacus
figures are computed from the run's rows (``client_app.reprogram_clients``). A round trained
again (a message asked again, a resumed run) counts twice when the node's noise is fresh OS
entropy, since the two releases of the same records are independent, and once with seeded noise,
which releases the very same tensor again (``prior``).

The floor. With local DP the server is the party the noise protects against, so a node cannot
take the server's word for how much noise is enough: the run config and the noise level both come
from the server, and a malicious or buggy one could send a tiny sigma with a config that agrees.
An organisation states its own limit in its node config::

    flower-supernode ... --node-config "data-dir='/data' state-dir='/var/lib/fedvlm' max-epsilon=3.0 delta=1e-5"

It needs a ``state-dir``: a limit is only worth what the ledger remembers. The node checks, with
the run's accountant and its own delta, what a record of its data would spend:
- at the handshake (``hello_check``): everything in its ledger composed with the plan it computes
  itself from the run config for its own records (``privacy.planner.local_plan``: the least noise
  the run's epsilon needs for its shape, which the server's plan only ever raises) over the run's
  ``num-server-rounds``; past the limit, it refuses the run with the epsilon spent and the limit,
  and the server excludes it;
- before every round it trains (``guard``), from what it will execute (this round's sigma, its
  clip, local steps, batch size and record count): its ledger's other runs composed with this
  noise over the whole run, and its whole ledger plus this round;
- once trained, just before the reply leaves (``record``): the second check again, under the
  ledger's lock, and the row is written only if it fits. A run that spent the budget meanwhile
  makes this reply stay on the node. A reply that is then lost still counts (conservative).
Its reply carries the epsilon its records have spent in this run (``node-epsilon``).

The limit holds only for noise nobody else can regenerate. A node that states one never defaults
to noise derived from the run seed (``privacy.mechanisms.node_noise_source``), and one whose node
config asks for it (``noise-source='seeded'``) is refused here: anyone holding the run config
could subtract that noise from what the node releases.

A method whose upload is not post-processing of the node's noise (DP-FPL, FedOTP, FedPGP: the
trusted server sees each client's un-noised global-prompt gradient) gives no bound against the
server, and a run without privacy none at all: a node with a floor refuses both.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from flwr.app import RecordDict

from fedvlm.client_app.state import LEDGER, STATE_DIR, load_meta, save_meta
from fedvlm.privacy.accounting import BudgetError, GaussianReleases, check_delta, epsilon_spent
from fedvlm.privacy.ledger import valid_sensitivity
from fedvlm.privacy.mechanisms import NOISE_SOURCE
from fedvlm.privacy.planner import ClientShape, LocalDP, NoiseRefused, local_plan
from fedvlm.protocol import TrainInstruction
from fedvlm.runconfig import ConfigError, RunConfig
from fedvlm.spec import spec_of
from fedvlm.utils.files import atomic_write_json, file_lock


class NodeData(Protocol):
    """What the ledger needs of a node (``client_app.node.NodeData``, which imports this module)."""

    name: str
    partition_id: int  # -1 for a node with its own data directory
    config: dict  # its node config
    noise_source: str


MAX_EPSILON, DELTA = "max-epsilon", "delta"  # the node config keys
COLUMNS = ("run", "round", "noise-multiplier", "steps", "sampling-rate", NOISE_SOURCE, "epsilon")
LEDGERS = "ledgers"  # the node's ledger files, under its state-dir
FORMAT = 1  # of a ledger file


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
        if not (0 < eps < math.inf) or not 0 < delta < 1:
            raise ConfigError(
                f"node config {MAX_EPSILON} = {node_config.get(MAX_EPSILON)!r}, {DELTA} = {node_config.get(DELTA)!r}: "
                f"set a finite {MAX_EPSILON} > 0 and 0 < {DELTA} < 1 (e.g. {MAX_EPSILON}=3.0 {DELTA}=1e-5)"
            )
        if not node_config.get(STATE_DIR):
            raise ConfigError(
                f"node config {MAX_EPSILON} needs {STATE_DIR}: the limit spans every run, so the node keeps the "
                f"ledger of what its records spent on its own disk; add {STATE_DIR}='/a/folder/of/this/node' "
                "(owner-only, kept across runs and restarts)"
            )
        return cls(eps, delta)


# ---- the ledger's two homes ---------------------------------------------------------------------
class Ledger(Protocol):
    def rows(self) -> list[dict]: ...

    def append(self, row: dict, check: Callable[[list[dict]], None], fresh: bool) -> list[dict]:
        """Add ``row`` after ``check`` (which raises to refuse) passed on the rows it joins
        (``prior``'s rule); every row after."""
        ...


def _row_of(values: dict) -> dict:
    """A row as stored, with the columns a row written before they existed lacks."""
    return {"run": "", NOISE_SOURCE: "os", **values}


class RunLedger:
    """The ledger of a node without a state-dir: this run's releases, in its private state."""

    def __init__(self, state: RecordDict):
        self.state = state

    def rows(self) -> list[dict]:
        columns = load_meta(self.state, LEDGER)  # one list per column
        if not columns:
            return []
        present = [c for c in COLUMNS if c in columns]
        return [
            _row_of(dict(zip(present, row, strict=True))) for row in zip(*(columns[c] for c in present), strict=True)
        ]

    def append(self, row: dict, check: Callable[[list[dict]], None], fresh: bool) -> list[dict]:
        rows = prior(self.rows(), row, fresh)
        check(rows)
        rows.append(row)
        save_meta(self.state, {c: [r[c] for r in rows] for c in COLUMNS}, LEDGER)
        return rows


class DiskLedger:
    """The ledger of a node with a state-dir: every release of its data, every run."""

    def __init__(self, path: Path, data: str):
        self.path, self.data = path, data

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        try:
            saved = json.loads(self.path.read_text())
            if saved.get("format") != FORMAT or saved.get("data") != self.data:
                raise ValueError(f"it is a ledger of format {saved.get('format')} for {saved.get('data')!r}")
            return [_row_of(r) for r in saved["rows"]]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError(
                f"this node's privacy ledger {self.path} cannot be read ({type(err).__name__}: {err}): restore it from "
                "a backup; do not delete it, or the node would forget what its records have spent"
            ) from err

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.path.parent, 0o700)
        with file_lock(self.path):
            yield

    def append(self, row: dict, check: Callable[[list[dict]], None], fresh: bool) -> list[dict]:
        with self._locked():
            rows = prior(self.rows(), row, fresh)
            check(rows)
            rows.append(row)
            atomic_write_json({"format": FORMAT, "data": self.data, "rows": rows}, self.path, durable=True)
        return rows


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._")[:48] or "node"


def data_identity(node: NodeData) -> str:
    """What the node's records are: its own folder (whichever node trains on it), or the
    partition it was given (the server chooses the dataset, the name is the node's)."""
    if node.partition_id < 0:
        return "folder " + os.path.realpath(str(node.config["data-dir"]))
    return f"partition node {node.name}"


def ledger(node: NodeData, state: RecordDict) -> Ledger:
    """The node's ledger: on its disk under its state-dir, else in the run's private state."""
    where = node.config.get(STATE_DIR)
    if not where:
        return RunLedger(state)
    data = data_identity(node)
    key = hashlib.sha256(data.encode()).hexdigest()[:16]
    name = Path(os.path.realpath(str(node.config["data-dir"]))).name if node.partition_id < 0 else node.name
    return DiskLedger(_ledger_file(Path(str(where)).expanduser().resolve() / LEDGERS, name, key), data)


def _ledger_file(folder: Path, name: str, key: str) -> Path:
    """The one file of these records' ledger, found by their identity's ``key`` whatever name it
    was first written under (until 2026-12-02 the data-dir as written: a symlink's name), else
    named now. Two files of one key would be two histories of the same records: refused."""
    found = sorted(folder.glob(f"*-{key}.json"))
    if len(found) > 1:
        raise ConfigError(
            f"this node's records have {len(found)} privacy ledgers ({', '.join(str(f) for f in found)}): merge "
            "their rows into one file and move the others away; the node will not guess which history is right"
        )
    return found[0] if found else folder / f"{_slug(name)}-{key}.json"


def prior(rows: list[dict], row: dict, fresh: bool) -> list[dict]:
    """The ledger a release joins. A round the node trains again (asked again, a resumed run) is a
    second release when its noise is fresh (``fresh``: OS noise) and counts twice; with seeded
    noise it is the same release, so the run's earlier seeded row of that round gives way to it."""
    if fresh:
        return list(rows)
    return [
        r
        for r in rows
        if not (r["run"] == row["run"] and int(r["round"]) == int(row["round"]) and r[NOISE_SOURCE] != "os")
    ]


def run_rows(rows: list[dict], run: str) -> list[dict]:
    return [r for r in rows if r["run"] == run]


def run_history(node: NodeData, state: RecordDict, run: str, server_round: int) -> list[dict]:
    """This run's releases that a release of ``server_round`` joins (``prior``'s rule)."""
    joining = {"run": run, "round": server_round}
    return run_rows(prior(ledger(node, state).rows(), joining, node.noise_source == "os"), run)


def _releases(rows: list[dict]) -> list[GaussianReleases]:
    """The rows as the accountant composes them: releases of one noise multiplier and sampling
    rate are one group (a ledger grows with every run; its composition need not)."""
    steps: dict[tuple[float, float], int] = {}
    for r in rows:
        key = (float(r["noise-multiplier"]), float(r["sampling-rate"]))
        steps[key] = steps.get(key, 0) + int(r["steps"])
    return [GaussianReleases(z, count, rate) for (z, rate), count in sorted(steps.items())]


# ---- what a round releases ----------------------------------------------------------------------
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


def _covered(floor: NodeFloor, cfg: RunConfig) -> LocalDP:
    """The run's local mechanism; refused where its noise bounds nothing the server sees (the
    module docstring)."""
    settings, spec = cfg.privacy, spec_of(cfg)
    if not settings.enabled or spec.local_dp is None:
        raise NoiseRefused(f"this run trains without privacy (no local noise), which {_limit(floor)} does not allow")
    local = spec.local_dp(cfg)
    if not local.noises_upload:
        raise NoiseRefused(
            f"method {spec.name} uploads a tensor that its local noise ({local.name}) does not cover (its server is "
            f"trusted with un-noised updates), so nothing bounds what the server learns: {_limit(floor)} does not "
            "allow it"
        )
    return local


def local_release(cfg: RunConfig, shape: ClientShape, sigma: float | None) -> tuple[GaussianReleases, str] | None:
    """What a round at ``sigma`` releases under the node's local noise, as the accountant reads it,
    and in words; None where that noise covers nothing that leaves the node (no privacy, no local
    mechanism, an upload the local noise does not cover, no noise level)."""
    settings, spec = cfg.privacy, spec_of(cfg)
    if not settings.enabled or spec.local_dp is None:
        return None
    local = spec.local_dp(cfg)
    if not local.noises_upload or sigma is None or not sigma > 0:
        return None
    z = sigma / valid_sensitivity(settings, *local.sensitivity(settings, shape))
    rate, steps = local.account_shape(settings, shape)
    what = (
        f"sigma {sigma:.4g} (noise multiplier {z:.4g}), {steps} step(s) a round at sampling rate {rate:.4g} over "
        f"{shape.n_train} records, {settings.accountant} accountant"
    )
    return GaussianReleases(z, steps, rate), what


def _spent(rows: list[dict], extra: list[GaussianReleases], floor: NodeFloor, cfg: RunConfig) -> float:
    return epsilon_spent([*_releases(rows), *extra], floor.delta, cfg.privacy.accountant)


def _over(value: float, floor: NodeFloor) -> bool:
    return value > floor.max_epsilon * (1 + 1e-9)


def hello_check(node: NodeData, state: RecordDict, cfg: RunConfig, num_train: int) -> None:
    """At the handshake: refuse a run the node's limit cannot take (the module docstring); nothing
    to check for a node without one."""
    floor = NodeFloor.from_node_config(node.config)
    if floor is None:
        return
    check_source(floor, node.noise_source)
    local = _covered(floor, cfg)
    shape = spec_of(cfg).family.local_shape(cfg, num_train)
    try:
        check_delta(floor.delta, num_train, "this node's", f"lower its node config {DELTA}")
        sigma = local_plan(cfg.privacy, local, shape, cfg.num_server_rounds).sigma
    except BudgetError as why:
        raise NoiseRefused(str(why)) from why
    released = local_release(cfg, shape, sigma)
    assert released is not None  # covered, and a plan's sigma is positive
    this, what = released
    rows = ledger(node, state).rows()
    spent = _spent(rows, [], floor, cfg)
    whole = GaussianReleases(this.noise_multiplier, this.count * cfg.num_server_rounds, this.sampling_rate)
    after = _spent(rows, [whole], floor, cfg)
    if _over(after, floor):
        runs = len({r["run"] for r in rows})
        raise NoiseRefused(
            f"this node's records have spent epsilon = {spent:.4g} of {_limit(floor)} over {runs} earlier run(s) "
            f"({len(rows)} release(s)); this run's plan (privacy.epsilon = {cfg.privacy.epsilon:g} over "
            f"{cfg.num_server_rounds} rounds, {what}) would bring them to {after:.4g}: refusing the run"
        )


@dataclass(frozen=True)
class Release:
    """The ledger row of a round the node is about to train, and whether it trains under its own
    limit (then its reply carries the epsilon its records have spent in this run)."""

    row: dict
    limited: bool
    what: str = ""  # the release in words, for a refusal


def _row(run: str, server_round: int, this: GaussianReleases, noise_source: str) -> dict:
    return {
        "run": run,
        "round": server_round,
        "noise-multiplier": this.noise_multiplier,
        "steps": this.count,
        "sampling-rate": this.sampling_rate,
        NOISE_SOURCE: noise_source,
        "epsilon": math.nan,  # the node's epsilon after this release, filled in by ``record``
    }


def _round_check(floor: NodeFloor, cfg: RunConfig, row: dict, what: str) -> Callable[[list[dict]], None]:
    """The check a round's release must pass against the rows it joins (the module docstring)."""
    this = _releases([row])[0]

    def check(rows: list[dict]) -> None:
        others = [r for r in rows if r["run"] != row["run"]]
        whole = GaussianReleases(this.noise_multiplier, this.count * cfg.num_server_rounds, this.sampling_rate)
        planned = _spent(others, [whole], floor, cfg)
        if _over(planned, floor):
            earlier = f" after what {len({r['run'] for r in others})} earlier run(s) spent" if others else ""
            raise NoiseRefused(
                f"the server's plan would spend epsilon = {planned:.4g} per record over {cfg.num_server_rounds} "
                f"rounds{earlier} ({what}), above {_limit(floor)}; refusing to train"
            )
        spent = _spent(rows, [this], floor, cfg)
        if _over(spent, floor):
            raise NoiseRefused(
                f"this round would bring this node's records to epsilon = {spent:.4g} after {len(rows) + 1} releases "
                f"in {len({r['run'] for r in rows} | {row['run']})} run(s) ({what}), above {_limit(floor)}; refusing "
                "to train"
            )

    return check


def guard(node: NodeData, state: RecordDict, cfg: RunConfig, instruction: TrainInstruction) -> Release | None:
    """Refuse the round if the node's floor forbids it; else what ``record`` writes once it
    trained (None: this round releases nothing the node's local noise covers)."""
    floor = NodeFloor.from_node_config(node.config)
    fresh = node.noise_source == "os"
    if floor is not None:
        check_source(floor, node.noise_source)
        _covered(floor, cfg)
        try:
            check_delta(floor.delta, instruction.num_train, "this node's", f"lower its node config {DELTA}")
        except BudgetError as why:
            raise NoiseRefused(str(why)) from why
    shape = ClientShape(instruction.num_train, instruction.batch_size, instruction.local_steps)
    released = local_release(cfg, shape, instruction.local_sigma)
    if released is None:
        if floor is not None:
            raise NoiseRefused(
                f"the server sent no local noise level; {_limit(floor)} does not allow training without it"
            )
        return None
    this, what = released
    row = _row(instruction.run_dir, instruction.server_round, this, node.noise_source)
    if floor is not None:
        _round_check(floor, cfg, row, what)(prior(ledger(node, state).rows(), row, fresh))
    return Release(row, limited=floor is not None, what=what)


def record(node: NodeData, state: RecordDict, cfg: RunConfig, release: Release) -> float:
    """Write a trained round into the node's ledger just before its reply leaves, checking its
    floor again under the ledger's lock (``NoiseRefused``: the reply stays on the node); the
    epsilon its records have spent in this run."""
    floor = NodeFloor.from_node_config(node.config)
    limit = floor or NodeFloor(math.inf, cfg.privacy.delta)
    row = dict(release.row)
    check = _round_check(floor, cfg, row, release.what) if floor is not None else (lambda rows: None)

    def checked(rows: list[dict]) -> None:
        check(rows)
        row["epsilon"] = _spent(rows, _releases([row]), limit, cfg)
        row["time"] = time.time()

    rows = ledger(node, state).append(row, checked, fresh=node.noise_source == "os")
    return _spent(run_rows(rows, row["run"]), [], limit, cfg)
