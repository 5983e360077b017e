"""The round loop: the strategy's Flower hooks, round after round, with the privacy budget's
stop, and every round written to the run folder before the next.

A round, as Flower's ``Strategy.start`` runs one, using only what the hooks return: admit the
nodes that joined (``admit``); build the train messages from the global arrays
(``configure_train``); stop here if they would take a record past ``privacy.max-epsilon``; build
the previous round's evaluate messages (``configure_evaluate``) and send both in one exchange
(``server_app.post``, the one owner of a round's messages); send the training's further stages while the strategy has
any (``next_stage``: secure aggregation's shares, masked sum and unmasking); complete the
previous round's record with its evaluation (``aggregate_evaluate``); aggregate the training
(``aggregate_train`` returns the new global arrays and the round's training figures); then the
round's record, built here from the round's plan (``strategies.plan``) and those figures, the
ledger, and the checkpoint a resumed run continues from (``server_app.resume``); with
``attack.observe-uploads``, also every train message and reply as the server saw them
(``server_app.observer``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid

from fedvlm.metrics import EPSILON_MEAN, EPSILON_SPENT, undeclared
from fedvlm.privacy.audit import audit_section, missing_section, refused
from fedvlm.protocol import FINAL_ROUND, RUN_DIR
from fedvlm.server_app.exchange import Exchanger
from fedvlm.server_app.observer import record_round
from fedvlm.server_app.post import Post
from fedvlm.server_app.results import RunRecorder, progress_line
from fedvlm.server_app.resume import ResumePoint, charge_abandoned, save_checkpoint, save_inflight
from fedvlm.spec import spec_of
from fedvlm.strategies.parts import RunParts
from fedvlm.strategies.records import RoundRecord, RunOutputs, with_evaluation

log = logging.getLogger(__name__)

# Everything this loop calls on the strategy: Flower's four round hooks, the round's further
# stages of training (``next_stage``: secure aggregation's), the run's start and the handshake
# of nodes that join (``begin``, ``admit``), the checkpoint's state, the number of rounds and the
# run's outputs. Everything else is the run's parts (``RunParts``); the messages
# between the hooks and the grid are the post's (``server_app.post``).
HOOKS = (
    "begin",
    "admit",
    "configure_train",
    "next_stage",
    "configure_evaluate",
    "aggregate_train",
    "aggregate_evaluate",
    "state_dict",
    "load_state_dict",
    "num_rounds",
    "outputs",
)


class RoundHooks(Protocol):
    """What the loop calls (``HOOKS``): a method's strategy (``strategies.base``), or a layer
    around one (``strategies.layers``)."""

    def begin(self, grid: Grid, resumed: dict | None = None) -> None: ...
    def admit(self, grid: Grid) -> None: ...
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]: ...
    def next_stage(self, server_round: int, replies: Iterable[Message]) -> Iterable[Message]: ...
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]: ...
    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]: ...
    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def num_rounds(self) -> int: ...
    def outputs(self, rounds: list[dict]) -> RunOutputs: ...


def _record_nodes(parts: RunParts, recorder: RunRecorder) -> None:
    nodes, excluded = parts.registry.table()
    run = recorder.data["run"]
    if run.get("nodes") != nodes or run.get("excluded_nodes") != excluded:
        recorder.set_run_info(nodes=nodes, excluded_nodes=excluded)


def _record_privacy(parts: RunParts, server_round: int, recorder: RunRecorder) -> dict[str, float]:
    """The round's ledger entry, written; the round's privacy figures for its record."""
    entry = parts.budget.record_round(server_round, parts.registry.noise_sources())
    _record_ledger(parts, recorder)
    if entry is None:
        return {}
    return {EPSILON_SPENT: entry["epsilon"], EPSILON_MEAN: entry["epsilon_mean"]}


def _record_ledger(parts: RunParts, recorder: RunRecorder) -> None:
    """results.json's privacy section as the ledger stands (none without privacy)."""
    section = parts.budget.ledger_section()
    if section is not None:
        recorder.add_section("privacy", section)


def _record_audit(parts: RunParts, recorder: RunRecorder, last_round: int | None = None) -> None:
    """The one-run audit's section, beside the ledger, once the audited node reported one; its
    verdict is ``last_round``'s (the run's planned last, or the round a budget stop ended it at).
    The run ends where the audited node refuses its canaries (``privacy.audit.refused``), and one
    that ends with no audit says so (``missing_section``)."""
    inputs, settings = parts.budget.audit_inputs(), parts.cfg.privacy
    if inputs is None or not settings.audit_canaries:
        return
    rounds, node = recorder.data["rounds"], parts.registry.audited()
    audited = node.name if node is not None else None
    if rounds:
        refused(rounds[-1], audited, settings)
    local, global_name = inputs
    end = parts.cfg.num_server_rounds if last_round is None else last_round
    section = audit_section(rounds, parts.budget.current(), local, global_name, (end, audited)) or missing_section(
        rounds, audited, settings, end
    )
    if section is None:
        return
    for name, node in section.get("nodes", {}).items():
        if node["status"].startswith("BROKEN"):
            log.error("privacy audit of %s: %s", name, node["status"])
    if "status" in section:
        log.error("privacy audit: %s", section["status"])
    recorder.add_section("audit", section)


def _figures(record: MetricRecord | None) -> dict[str, float]:
    """A hook's returned metrics, for the round's record: each must be declared (``fedvlm.metrics``),
    since results.json's summary, the plots and rounds.csv read the declaration."""
    figures = {k: v for k, v in (record or {}).items() if isinstance(v, (int, float))}
    missing = undeclared(figures)
    if missing:
        raise ValueError(
            f"the strategy returned round figures no metric declares: {', '.join(missing)}; declare "
            "each with fedvlm.metrics.register_metric"
        )
    return figures


def _phase_config(recorder: RunRecorder, final: bool | None = None) -> ConfigRecord:
    """What a phase's messages carry besides the plan: the run folder; for an evaluation,
    whether it is the run's last (nodes publish then)."""
    config = ConfigRecord({RUN_DIR: str(recorder.dir)})
    if final is not None:
        config[FINAL_ROUND] = final
    return config


@dataclass
class _Run:
    """What every step of the loop works with besides the strategy."""

    parts: RunParts
    post: Post
    recorder: RunRecorder
    grid: Grid
    total: int  # the run's rounds
    started: dict[int, float] = field(default_factory=dict)  # round -> when it began (its seconds run to the next's)

    def since(self, server_round: int, now: float | None = None) -> float | None:
        """Seconds from round ``server_round``'s start to ``now`` (None: not started in this process)."""
        start = self.started.get(server_round)
        return None if start is None else (time.time() if now is None else now) - start


def _evaluation(strategy: RoundHooks, run: _Run, server_round: int, arrays: ArrayRecord, final: bool) -> list[Message]:
    """Round ``server_round``'s evaluate messages (a fresh plan of its evaluation)."""
    return list(strategy.configure_evaluate(server_round, arrays, _phase_config(run.recorder, final=final), run.grid))


def _evaluate_alone(
    strategy: RoundHooks, run: _Run, server_round: int, arrays: ArrayRecord, final: bool
) -> list[Message]:
    """Round ``server_round``'s evaluation sent in an exchange of its own (no train messages to
    travel with), to the nodes connected now; its replies."""
    strategy.admit(run.grid)
    return run.post.send(None, [], server_round, _evaluation(strategy, run, server_round, arrays, final))


def _settle(strategy: RoundHooks, run: _Run, server_round: int, replies: list[Message], seconds: float | None) -> None:
    """Round ``server_round``'s evaluation is back (in ``replies``, among an exchange's others):
    its figures complete the round's record, which the run folder then holds."""
    figures = _figures(strategy.aggregate_evaluate(server_round, replies))
    evaluation = RoundRecord.of(run.post.take(server_round), figures)
    parts, recorder = run.parts, run.recorder
    rounds = recorder.data["rounds"]
    at = next(i for i, r in enumerate(rounds) if r["round"] == server_round)
    rounds[at] = with_evaluation(rounds[at], evaluation, seconds)
    with recorder.one_write():
        _record_ledger(parts, recorder)  # what the evaluation released beside the noised tensors
        _record_audit(parts, recorder)
        _record_nodes(parts, recorder)  # nodes may have joined or been excluded since
        recorder.write()
    log.info(progress_line(rounds[at], run.total))


def _begin(strategy: RoundHooks, run: _Run, resume: ResumePoint | None) -> None:
    """The run's start (or its resumption from ``resume``'s checkpoint), recorded."""
    strategy.begin(run.grid, resume.state if resume is not None else None)
    if resume is not None:
        strategy.load_state_dict(resume.state)
        run.recorder.data["run"]["resumed"][-1].update(charge_abandoned(run.parts, resume))
    _record_nodes(run.parts, run.recorder)
    _record_ledger(run.parts, run.recorder)


def _train_messages(strategy: RoundHooks, run: _Run, rnd: int, arrays: ArrayRecord) -> tuple[list[Message], str]:
    """Round ``rnd``'s train messages, their privacy charged; or none and why the budget stops
    the run here (the round is then dropped unsent: it leaves no trace)."""
    parts = run.parts
    train = list(strategy.configure_train(rnd, arrays, _phase_config(run.recorder), run.grid))
    trainees = [parts.registry.nodes[m.metadata.dst_node_id].name for m in train]
    over = parts.budget.charge_round(trainees)
    if over is not None:
        run.post.take(rnd)
        note = (
            f"privacy budget reached: round {rnd} would bring epsilon to {over:.4g}, above "
            f"privacy.max-epsilon = {parts.cfg.privacy.max_epsilon}; stopped after round {rnd - 1}"
        )
        log.warning(note)
        return [], note
    save_inflight(run.recorder.dir, rnd, trainees)
    return train, ""


def _exchange(
    strategy: RoundHooks, run: _Run, rnd: int, train: list[Message], owed: int | None, arrays: ArrayRecord
) -> list[Message]:
    """Round ``rnd``'s exchange (its train messages with round ``owed``'s evaluation), then its
    later stages while the strategy has any (secure aggregation's); every reply."""
    evaluation = _evaluation(strategy, run, owed, arrays, final=False) if owed is not None else []
    replies = stage = run.post.send(rnd, train, owed, evaluation)
    while train and (more := list(strategy.next_stage(rnd, stage))):
        stage = run.post.send_stage(rnd, more)
        replies = replies + stage
    return replies


def _aggregate(
    strategy: RoundHooks, run: _Run, rnd: int, train: list[Message], replies: list[Message]
) -> tuple[ArrayRecord | None, dict[str, float]]:
    """Round ``rnd``'s training aggregated (the new global arrays, None if unchanged; its figures),
    while both phases' plans are held, so that each knows the other's replies."""
    if run.parts.cfg.attack.observe_uploads:  # the honest-but-curious server keeps what it saw
        record_round(run.recorder.dir, rnd, train, replies, run.parts.registry.nodes)
    new_arrays, train_metrics = strategy.aggregate_train(rnd, replies)
    return new_arrays, _figures(train_metrics)


def _write_round(run: _Run, rnd: int, metrics: dict[str, float], t0: float, evaluates: bool) -> None:
    """Round ``rnd``'s record, from its plan and ``metrics``, with the ledger, into the run folder."""
    parts, recorder = run.parts, run.recorder
    with recorder.one_write():
        metrics.update(_record_privacy(parts, rnd, recorder))
        plan = run.post.take(rnd)  # none for a method that does not train
        record = RoundRecord.of(plan, metrics).as_dict(time.time() - t0, evaluated=False if evaluates else None)
        recorder.add_round(record)
        if not evaluates:  # complete as written: no evaluation will add to it
            log.info(progress_line(record, run.total))
        _record_audit(parts, recorder)
        _record_nodes(parts, recorder)  # nodes may have joined or been excluded since


def _finish(strategy: RoundHooks, run: _Run, rnd: int, owed: int | None, arrays: ArrayRecord, stopped: bool) -> None:
    """After the last round ``rnd``: the run's last evaluation, of the state reached, where one is
    still due (after the budget's stop, or in a resumed run that was cut off in it), so that the
    nodes publish it; it completes that round's record where it was still owed. Then the run's
    final arrays and the strategy's outputs."""
    recorder = run.recorder
    if stopped or owed is not None:
        replies = _evaluate_alone(strategy, run, rnd, arrays, final=True)
        last = next((r for r in recorder.data["rounds"] if r["round"] == rnd), None)
        if owed == rnd or (last is not None and last["evaluated"] is None):  # the state published: its figures
            _settle(strategy, run, rnd, replies, run.since(rnd))
        else:
            run.post.take(rnd)
    if stopped:  # the budget ended the run here: this round's audit is its test
        _record_audit(run.parts, recorder, last_round=rnd)
    if run.parts.arrays:
        recorder.save_arrays("final_shared.pt", run.parts.arrays, rnd)
    outputs = strategy.outputs(recorder.data["rounds"])
    for name, saved in outputs.arrays.items():
        recorder.save_arrays(name, saved, rnd)
    for key, section in outputs.sections.items():
        recorder.add_section(key, section)


def run_rounds(
    strategy: RoundHooks,
    parts: RunParts,
    grid: Grid,
    recorder: RunRecorder,
    resume: ResumePoint | None = None,
) -> dict:
    """Run every round of ``strategy`` (built on ``parts``, the run's parts, which this loop
    reads and records from) on ``grid`` (after ``resume``'s round, if given); returns the
    finished results. The strategy is called only through its hooks (``HOOKS``).

    A round's evaluation travels with the next round's train messages (``server_app.post``):
    one exchange per round instead of two, each a round trip through the SuperLink on a real
    deployment. Its record is written when the round's training is done (``evaluated``: false)
    and completed when the evaluation comes back; the last round's evaluation, and any round's
    of a method that does not train, go out on their own. With ``evaluate-every`` k, only every
    k-th round and the last are evaluated; the others' records are complete when written
    (``evaluated`` None: ``strategies.records.complete``)."""
    cfg = parts.cfg
    run = _Run(parts, Post(parts, Exchanger(grid, cfg.round_timeout, cfg.reply_grace)), recorder, grid, 0)
    _begin(strategy, run, resume)
    run.total = total = strategy.num_rounds()
    arrays = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in parts.arrays.items()})
    owed = resume.round if resume is not None and resume.evaluation_owed else None  # the round whose evaluation is due
    note, rnd = "", resume.round if resume is not None else 0
    for rnd in range(resume.round + 1 if resume else 1, total + 1):
        run.started[rnd] = t0 = time.time()
        strategy.admit(grid)
        train, note = _train_messages(strategy, run, rnd, arrays) if spec_of(cfg).trains else ([], "")
        if note:  # the budget's stop
            rnd -= 1
            break
        replies = _exchange(strategy, run, rnd, train, owed, arrays)
        metrics: dict[str, float] = {}
        if train:
            new_arrays, metrics = _aggregate(strategy, run, rnd, train, replies)
            arrays = new_arrays if new_arrays is not None else arrays
        if owed is not None:
            _settle(strategy, run, owed, replies, run.since(owed, t0))
        evaluates = rnd == total or rnd % cfg.evaluate_every == 0
        _write_round(run, rnd, metrics, t0, evaluates)
        save_checkpoint(recorder.dir, strategy.state_dict(), parts.arrays, rnd)
        owed = rnd if evaluates else None
        if evaluates and (not train or rnd == total):  # nothing to travel with: evaluated on its own
            _settle(strategy, run, rnd, _evaluate_alone(strategy, run, rnd, arrays, final=rnd == total), run.since(rnd))
            owed = None
    _finish(strategy, run, rnd, owed, arrays, stopped=bool(note))
    return recorder.finish("stopped" if note else "finished", note)
