"""The ServerApp: validate the run config, build the method's strategy, run the rounds and
write the run folder (results.json, shared parameters, plots, a printed summary), or go on
with an interrupted run's folder (``resume``, ``server_app.resume``)."""

from __future__ import annotations

import logging
import sys

import flwr
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedvlm.deploy import object_batches, simulation_polls
from fedvlm.deploy.instruction_signing import SIGNING_KEY_ENV, key_id, sign_pushes, signing_key_from_env
from fedvlm.methods.validation import validate
from fedvlm.runconfig import ConfigError, RunConfig
from fedvlm.server_app.loop import RoundHooks, run_rounds
from fedvlm.server_app.results import RunRecorder, make_run_dir, summary_table
from fedvlm.server_app.resume import clear_refused, hold_run_dir, note_refused, resume_point
from fedvlm.server_app.tracking import Trackers
from fedvlm.spec import spec_of
from fedvlm.strategies.base import ResumeError
from fedvlm.strategies.layers import wrap
from fedvlm.strategies.parts import RunParts
from fedvlm.utils.files import UnreadableFile
from fedvlm.utils.floats import compute_report, flush_denormals
from fedvlm.utils.runtime import simulated_grid

log = logging.getLogger("fedvlm")
app = ServerApp()


def _setup_logging() -> None:
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        # every module logs under "fedvlm.<package>.<module>", children of this one logger
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def _run_info(cfg: RunConfig, backbone: dict | None, run_id: int | str) -> dict:
    """results.json's ``run`` section of a new run: the method, Flower, the backbone it loaded."""
    spec = spec_of(cfg)
    return {
        "method": spec.name,
        "family": spec.family.name,
        "summary": spec.summary,
        "run_id": str(run_id),
        "flwr": flwr.__version__,
        "backbone": backbone,
        "compute": compute_report(),  # the ServerApp's own (each node's is in its handshake)
    }


def execute(cfg: RunConfig, grid, run_id: int | str) -> RunRecorder:
    """Run a validated config on a grid (Flower's, or an in-process one) and write the run
    folder; returns the recorder holding everything that was written."""
    spec = spec_of(cfg)
    flush_denormals()  # before the server's backbone loads (utils.floats)
    try:
        point = resume_point(cfg)
        held = hold_run_dir(point.run_dir) if point is not None else None
    except (ResumeError, UnreadableFile) as err:  # a damaged file of the folder: refused, named, kept
        note_refused(cfg, err)
        raise
    parts = RunParts.of(cfg)  # the run's parts: the loop owns them, the strategy's hooks use them
    method = spec.strategy(parts)
    # a cross-cutting feature is a layer around the method's strategy, as Flower's wrappers are
    strategy: RoundHooks = wrap(method)
    if point is not None:
        assert held is not None  # held above, with the resume point
        log.info("resuming %s after its round %d", point.run_dir, point.round)
        recorder = RunRecorder.reopen(point.run_dir, point.results, point.round, cfg.as_dict(), str(run_id))
    else:
        run_dir = make_run_dir(cfg.output_dir, cfg.run_name, spec.name, cfg.dataset, run_id)
        held = hold_run_dir(run_dir)
        log.info("run folder: %s", run_dir)
        recorder = RunRecorder(run_dir, cfg.as_dict(), _run_info(cfg, method.backbone(), run_id))
    trackers = Trackers.of(cfg, recorder.dir)
    if trackers.make:
        # a folder still 'running' was left by a ServerApp that never ended it (killed outright)
        ended = point is not None and point.results["run"].get("status") != "running"
        recorder.track(trackers, resumed=point is not None, ended=ended)
    try:
        run_rounds(strategy, parts, grid, recorder, point)
    except ResumeError as err:  # refused before anything was recorded: the folder is as it was
        log.error("cannot resume: %s", err)
        note_refused(cfg, err)
        raise
    except (KeyboardInterrupt, SystemExit) as err:  # stopped from outside (Ctrl-C, the SuperLink going down)
        recorder.finish("interrupted", f"{type(err).__name__}; continue it with resume='{recorder.dir}'")
        log.error("run interrupted after round %d: resume with resume='%s'", len(recorder.data["rounds"]), recorder.dir)
        raise
    except BaseException as err:
        recorder.finish("failed", f"{type(err).__name__}: {err}")
        log.error("run failed: %s (results so far: %s)", err, recorder.path)
        raise
    else:
        clear_refused(recorder.dir)
    finally:
        held.close()  # the folder is free (a crash frees it too: the lock dies with the process)
    print(summary_table(recorder.data), flush=True)
    log.info("results: %s", recorder.path)
    return recorder


def run(raw: dict, grid, run_id: int | str) -> RunRecorder:
    """Validate ``raw`` and execute it; a refused config still leaves a failed run folder."""
    try:
        cfg = validate(raw)
    except ConfigError as err:
        recorder = RunRecorder.refused(raw, run_id, str(err))
        log.error("invalid run config: %s (run folder: %s)", err, recorder.dir)
        raise
    return execute(cfg, grid, run_id)


def sign_instructions(grid) -> None:
    """Sign every message this ServerApp sends with its host's key, where the host names one
    (``deploy.instruction_signing``); a deployed run without one says so, since nodes that pin
    the federation's key refuse unsigned messages."""
    key = signing_key_from_env()
    if key is not None:
        sign_pushes(grid, key)
        log.info("every instruction is signed with the federation's ServerApp key %s", key_id(key.public_key()))
    elif not simulated_grid(grid):
        log.warning(
            "%s is not set: this ServerApp's messages are unsigned, and nodes that pin the federation's "
            "server-signing.pub refuse them (docs/deployment.md, section 2)",
            SIGNING_KEY_ENV,
        )


@app.main()
def main(grid: Grid, context: Context) -> None:
    _setup_logging()
    if simulated_grid(grid):  # the engine that hands out the messages shares this process
        simulation_polls.install()
    else:  # a deployed ServerApp pulls its replies' objects (in one request each); a simulation none
        object_batches.install_clients()
    sign_instructions(grid)
    run(dict(context.run_config), grid, context.run_id)
