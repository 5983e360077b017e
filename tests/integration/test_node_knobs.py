"""Every privacy knob the server sets, against a node that states its own limit.

The run config is the server's, and so is every train message. For each knob that changes what a
record spends, a hostile server here sets it adversarially and sends the node exactly what an
honest server of that config would send (its planned sigma; on one row it also sends more rounds
than it announced). The node (``max-epsilon=3 delta=1e-5`` in its own node config) must either
refuse before it releases anything, or train and report in its own ledger the epsilon that an
independent accountant gives for what it actually released: every private step is recorded as it
happens (clip norm, divisor, sigma, noised groups, how its batch was sampled), and the
composition is written out here with dp-accounting's events. docs/privacy.md's table "Every privacy
knob the server sets, checked by the node" has one row per case.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import dp_accounting
import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from fedvlm.client_app import prompt_clients, trainer
from fedvlm.client_app.app import app as client_app
from fedvlm.privacy.planner import local_plan
from fedvlm.protocol import SERVER_ROUND, TrainInstruction
from fedvlm.spec import spec_of

LIMIT, NODE_DELTA = 3.0, 1e-5
NODE = {"partition-id": 0, "num-partitions": 2, "max-epsilon": LIMIT, "delta": NODE_DELTA}  # + its state-dir


@dataclass
class Release:
    """One private step of the node, as it ran."""

    sensitivity: float
    sigma: float
    sampling_rate: float


@dataclass
class Recorder:
    """Records what the node's mechanism actually does (wrapping the functions the training loop
    and pFedMoAP's upload call), from which the epsilon is recomputed independently."""

    uniform: bool  # fixed-size batches (the paper's calibration): a record displaces another
    releases: list[Release] = field(default_factory=list)
    rate: float = 1.0  # the sampling of the batches being drawn now

    def install(self, monkeypatch) -> None:
        real_batches, real_sample, real_whole = trainer.batches, trainer.privatize, trainer.privatize_batch

        def noised_groups(step) -> int:
            return sum(1 for g in step.groups if any(k in step.noised for k in g))

        def batches(n, batch_size, steps, settings, rng):
            poisson = settings.enabled and settings.sampling == "poisson"
            self.rate = batch_size / n if poisson and n > batch_size else 1.0
            return real_batches(n, batch_size, steps, settings, rng)

        def privatize(per_sample, step, noise, shapes):
            # each record's gradient clipped to C per group, the sum divided by B
            sens = math.sqrt(noised_groups(step)) * step.clip / step.expected_batch * (2 if self.uniform else 1)
            self.releases.append(Release(sens, step.sigma, self.rate))
            return real_sample(per_sample, step, noise, shapes)

        def privatize_whole(grads, step, noise, rate=None):
            # the whole gradient (a batch's, or a round's update) clipped to C: a record moves it by 2C
            sens = math.sqrt(noised_groups(step)) * 2 * step.clip
            self.releases.append(Release(sens, step.sigma, self.rate if rate is None else rate))
            return real_whole(grads, step, noise)

        monkeypatch.setattr(trainer, "batches", batches)
        monkeypatch.setattr(trainer, "privatize", privatize)
        monkeypatch.setattr(trainer, "privatize_batch", privatize_whole)
        # pFedMoAP's upload: the round's update, every record in it (no sampling)
        monkeypatch.setattr(prompt_clients, "privatize_batch", lambda g, s, n: privatize_whole(g, s, n, rate=1.0))

    def epsilon(self, accountant: str) -> float:
        events = []
        for r in self.releases:
            one = dp_accounting.GaussianDpEvent(r.sigma / r.sensitivity)
            events.append(one if r.sampling_rate >= 1.0 else dp_accounting.PoissonSampledDpEvent(r.sampling_rate, one))
        acc = (
            dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
            if accountant == "pld"
            else dp_accounting.rdp.RdpAccountant()
        )
        acc.compose(dp_accounting.ComposedDpEvent(events))
        return acc.get_epsilon(NODE_DELTA)


class HostileServer:
    """Sends the node what an honest server of ``cfg`` would: the handshake, then train messages
    with the plan and sigma the real planner makes for that config."""

    def __init__(self, cfg, pretrained_clip, state_dir):
        self.cfg = cfg
        node_config = {**NODE, "state-dir": str(state_dir)}  # a fresh node: its ledger is empty
        self.context = Context(
            run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config=cfg.as_dict()
        )
        width = pretrained_clip.model.token_embedding.weight.shape[1]
        self.ctx = np.random.default_rng(0).normal(0, 0.02, (cfg.prompt.n_ctx, width)).astype(np.float32)

    def hello(self) -> str | None:
        """None once the node answered the handshake; the reason it refused the run otherwise."""
        msg = Message(RecordDict({"config": ConfigRecord({SERVER_ROUND: 0})}), dst_node_id=7, message_type="query")
        try:
            reply = client_app(msg, self.context)
        except Exception as err:  # noqa: BLE001 - a refusal, as the server would read it
            return f"{type(err).__name__}: {err}"
        assert not reply.has_error(), reply.error.reason
        self.n_train = int(reply.content["metrics"]["num-train"])
        self.info = dict(reply.content["info"])
        return None

    def train(self, server_round: int) -> dict | str:
        """The node's reply metrics, or the reason it refused (its exception, which Flower would
        send back as the error reply)."""
        cfg = self.cfg
        shape = spec_of(cfg).family.local_shape(cfg, self.n_train)
        sigma = (
            local_plan(cfg.privacy, spec_of(cfg).local_dp(cfg), shape, cfg.num_server_rounds).sigma
            if cfg.privacy.enabled
            else None
        )
        instruction = TrainInstruction(server_round, ("ctx",), shape.steps, shape.batch_size, self.n_train, sigma, "")
        content = RecordDict(
            {"arrays": ArrayRecord({"ctx": Array(self.ctx)}), "config": ConfigRecord(instruction.to_config())}
        )
        try:
            reply = client_app(Message(content, dst_node_id=7, message_type=MessageType.TRAIN), self.context)
        except Exception as err:  # noqa: BLE001 - any refusal, as the server would read it
            return f"{type(err).__name__}: {err}"
        return dict(reply.content["metrics"])


@dataclass(frozen=True)
class Knob:
    """One row of docs/privacy.md's table: the knob, the server's adversarial setting, the outcome."""

    knob: str
    overrides: dict
    refuses: str = ""  # a regex of the refusal; "" = the node trains and accounts for it
    rounds_sent: int = 1  # train messages the server sends (more than num-server-rounds: it lies)


# how the node refuses a plan past its limit: at the handshake (from the plan it computes itself),
# or at a round (from the sigma it is sent)
OVER = r"(?:plan would spend epsilon = |would bring them to )"
BASE = {"method": "promptfl", "num-server-rounds": 2, "max-per-class": 8, "privacy.epsilon": 2.0}
KNOBS = [
    Knob("privacy.epsilon", {"privacy.epsilon": 50.0}, OVER + "50"),
    Knob("privacy.noise-multiplier", {"privacy.epsilon": 0.0, "privacy.noise-multiplier": 0.3}, OVER),
    Knob("privacy.clip", {"privacy.clip": 1000.0}),
    Knob("privacy.clipping", {"privacy.clipping": "per-batch"}, OVER + r"\d+"),
    Knob("privacy.calibration", {"privacy.calibration": "paper"}, OVER),
    Knob("privacy.accountant", {"privacy.accountant": "pld"}),
    Knob("privacy.delta", {"privacy.delta": 0.05, "privacy.epsilon": 2.9}, OVER + "[3-9]"),
    Knob("prompt.batch-size", {"prompt.batch-size": 10_000}),
    Knob(
        "prompt.local-steps",
        {"privacy.epsilon": 0.0, "privacy.noise-multiplier": 1.5, "prompt.local-steps": 20},
        OVER,
    ),
    Knob(
        "num-server-rounds",
        {"privacy.epsilon": 0.0, "privacy.noise-multiplier": 1.0, "num-server-rounds": 1},
        r"bring this node's records to epsilon = .* after \d+ releases",
        rounds_sent=40,
    ),
    Knob("fraction-train", {"fraction-train": 0.1}),
    Knob("privacy.noise-source", {"privacy.noise-source": "seeded"}),
    Knob("pfedmoap.dp-placement", {"method": "pfedmoap", "pfedmoap.dp-placement": "upload"}),
    Knob("privacy.audit-canaries", {"privacy.audit-canaries": 40, "privacy.audit-node": 0}),
    Knob("privacy (off)", {"privacy.epsilon": 0.0}, r"trains without privacy"),
    Knob("method (trusted server)", {"method": "dpfpl"}, r"uploads a tensor that its local noise .* does not cover"),
]


@pytest.mark.parametrize("knob", KNOBS, ids=lambda k: k.knob)
def test_the_node_refuses_or_accounts_for_what_it_released(knob, make_cfg, pretrained_clip, monkeypatch, tmp_path):
    raw = {**BASE, **knob.overrides}
    cfg = make_cfg(**{k.replace(".", "__").replace("-", "_"): v for k, v in raw.items()})
    recorder = Recorder(uniform=cfg.privacy.enabled and cfg.privacy.sampling == "uniform")
    recorder.install(monkeypatch)
    server = HostileServer(cfg, pretrained_clip, tmp_path / "node-state")
    # a plan past the limit is refused at the handshake already (the node plans for itself)
    outcome: dict | str = server.hello() or {}
    if not outcome:
        assert server.info["noise-source"] == "os"  # a node with a limit: whatever the run config says
    for r in range(1, knob.rounds_sent + 1 if not outcome else 1):
        before = len(recorder.releases)
        outcome = server.train(r)
        if isinstance(outcome, str):
            assert len(recorder.releases) == before, "it released, then refused"
            break
        spent = float(outcome["node-epsilon"])
        assert spent == pytest.approx(recorder.epsilon(cfg.privacy.accountant), rel=2e-3), (r, spent)
        assert spent <= LIMIT * (1 + 1e-9)
    if knob.refuses:
        assert isinstance(outcome, str), "the node trained"
        assert outcome.startswith("NoiseRefused") and re.search(knob.refuses, outcome), outcome
        assert bool(recorder.releases) == (knob.rounds_sent > 1)  # refused before any private step of that round
    else:
        assert isinstance(outcome, dict), outcome
        assert recorder.releases


def test_the_recorder_sees_every_release(make_cfg, pretrained_clip, monkeypatch, tmp_path):
    """The independent figure is only as good as the record of releases: one round of PromptFL
    at one local step is exactly one Poisson-sampled Gaussian release."""
    cfg = make_cfg(**{k.replace(".", "__").replace("-", "_"): v for k, v in BASE.items()})
    recorder = Recorder(uniform=False)
    recorder.install(monkeypatch)
    server = HostileServer(cfg, pretrained_clip, tmp_path / "node-state")
    assert server.hello() is None
    assert isinstance(server.train(1), dict)
    (only,) = recorder.releases
    shape = spec_of(cfg).family.local_shape(cfg, server.n_train)
    assert only.sampling_rate == pytest.approx(shape.batch_size / server.n_train)
    assert only.sensitivity == pytest.approx(cfg.privacy.clip / shape.batch_size)
    assert only.sigma > 0
