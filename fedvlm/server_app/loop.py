"""The round loop: the strategy's Flower hooks, round after round, with the privacy budget's
stop, and every round written to the run folder before the next.

A round: sample and build the train messages (``configure_train``); stop here if they would
take a record past ``privacy.max-epsilon``; send, validate and aggregate the replies; evaluate;
record the round (metrics, bytes, per-client figures, dropped replies, the ledger) and the
checkpoint a resumed run continues from (``server_app.resume``); with
``attack.observe-uploads``, also every train message and reply as the server saw them
(``server_app.observer``).
"""

from __future__ import annotations

import logging
import time

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord
from flwr.serverapp import Grid

from fedvlm.privacy.audit import audit_section
from fedvlm.server_app.exchange import Exchanger
from fedvlm.server_app.observer import record_round
from fedvlm.server_app.results import RunRecorder, progress_line
from fedvlm.server_app.resume import ResumePoint, charge_abandoned, save_checkpoint, save_inflight
from fedvlm.strategies.base import FederatedStrategy

log = logging.getLogger(__name__)


def _record_nodes(strategy: FederatedStrategy, recorder: RunRecorder) -> None:
    nodes, excluded = strategy.registry.table()
    run = recorder.data["run"]
    if run.get("nodes") != nodes or run.get("excluded_nodes") != excluded:
        recorder.set_run_info(nodes=nodes, excluded_nodes=excluded)


def _record_privacy(strategy: FederatedStrategy, server_round: int, recorder: RunRecorder) -> None:
    budget = strategy.budget
    if budget is None:
        return
    entry = strategy.privacy_entry()
    budget.record_noise_sources(strategy.noise_sources())  # nodes may have joined since the last round
    strategy.ledger.record_round(server_round, entry)
    strategy.current.metrics["epsilon/per-record-max"] = entry["epsilon"]
    recorder.add_section("privacy", strategy.ledger.as_dict())


def _record_audit(strategy: FederatedStrategy, recorder: RunRecorder) -> None:
    """The one-run audit's section, beside the ledger, once the audited node reported one."""
    budget = strategy.budget
    if budget is None or budget.planner.local is None or not strategy.privacy.audit_canaries:
        return
    global_dp = budget.planner.global_dp
    section = audit_section(
        recorder.data["rounds"],
        strategy.ledger.rounds[-1] if strategy.ledger.rounds else {},
        budget.planner.local,
        global_dp.name if global_dp else None,
    )
    if section is None:
        return
    for name, node in section["nodes"].items():
        if node["status"].startswith("BROKEN"):
            log.error("privacy audit of %s: %s", name, node["status"])
    recorder.add_section("audit", section)


def run_rounds(
    strategy: FederatedStrategy, grid: Grid, recorder: RunRecorder, resume: ResumePoint | None = None
) -> dict:
    """Run every round of ``strategy`` on ``grid`` (after ``resume``'s round, if given);
    returns the finished results."""
    strategy.run_dir = str(recorder.dir)
    strategy.start(grid, resume.state if resume is not None else None)
    if resume is not None:
        strategy.load_state_dict(resume.state)
        recorder.data["run"]["resumed"][-1].update(charge_abandoned(strategy, resume))
    _record_nodes(strategy, recorder)
    if strategy.budget is not None:
        recorder.add_section("privacy", strategy.ledger.as_dict())
    exchange = Exchanger(grid, strategy.cfg.round_timeout, strategy.cfg.reply_grace)
    total = strategy.num_rounds()
    empty = ConfigRecord()
    status, note, rnd = "finished", "", 0
    for rnd in range(resume.round + 1 if resume else 1, total + 1):
        t0 = time.time()
        strategy.begin_round(rnd, final=rnd == total)
        current = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in strategy.global_arrays.items()})
        if strategy.spec.trains:
            messages = list(strategy.configure_train(rnd, current, empty, grid))
            trainees = [strategy.nodes[m.metadata.dst_node_id].name for m in messages]
            over = strategy.budget.would_exceed(trainees) if strategy.budget is not None else None
            if over is not None:
                status = "stopped"
                note = (
                    f"privacy budget reached: round {rnd} would bring epsilon to {over:.4g}, above "
                    f"privacy.max-epsilon = {strategy.privacy.max_epsilon}; stopped after round {rnd - 1}"
                )
                log.warning(note)
                rnd -= 1
                # one more evaluation of the state reached, so that clients publish it
                strategy.begin_round(rnd, final=True)
                exchange.run(list(strategy.configure_evaluate(rnd, current, empty, grid)), strategy.ask_again)
                break
            if strategy.budget is not None:
                strategy.budget.spend(trainees)
            save_inflight(recorder.dir, rnd, trainees)
            uploads = exchange.run(messages, strategy.ask_again)
            if strategy.cfg.attack.observe_uploads:  # the honest-but-curious server keeps what it saw
                record_round(recorder.dir, rnd, messages, uploads, strategy.nodes)
            strategy.aggregate_train(rnd, uploads)
        replies = exchange.run(list(strategy.configure_evaluate(rnd, current, empty, grid)), strategy.ask_again)
        strategy.aggregate_evaluate(rnd, replies)
        _record_privacy(strategy, rnd, recorder)
        record = strategy.current.as_dict(time.time() - t0)
        recorder.add_round(record)
        _record_audit(strategy, recorder)
        _record_nodes(strategy, recorder)  # nodes may have joined or been excluded since
        save_checkpoint(recorder.dir, strategy, rnd)
        log.info(progress_line(record, total))
    if strategy.global_arrays:
        recorder.save_arrays("final_shared.pt", strategy.global_arrays, rnd)
    outputs = strategy.outputs(recorder.data["rounds"])
    for name, arrays in outputs.arrays.items():
        recorder.save_arrays(name, arrays, rnd)
    for key, section in outputs.sections.items():
        recorder.add_section(key, section)
    return recorder.finish(status, note)
