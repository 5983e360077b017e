"""Issue 46: a new method that reports a new figure, and a new accountant, are each one
registration; a real federation then validates, records and plots them with nothing else touched."""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest
from dp_accounting import rdp

from fedvlm.client_app.app import app as client_app
from fedvlm.client_app.prompt_clients import PromptFLClient
from fedvlm.methods.registry import METHODS, register_method
from fedvlm.metrics import EPSILON_SPENT, METRICS, NUM_EXAMPLES, TRAIN, Combine, Kind, Metric
from fedvlm.privacy.accountants import ACCOUNTANTS, Accountant, register_accountant
from fedvlm.privacy.accounting import GaussianReleases
from fedvlm.runconfig import ConfigError
from fedvlm.server_app.app import execute
from fedvlm.strategies.validation import ReplyRejected, check_metric
from fedvlm.tensor_names import CTX
from fedvlm.utils.inprocess import InProcessGrid

NORM = Kind("norm", 0.0, 1e6, axis="L2 norm")
PROMPT_NORM = Metric(
    "prompt-norm",
    NORM,
    "L2 norm of the prompt a node uploads",
    frozenset({TRAIN}),
    combine=Combine("weighted", "prompt-norm", NUM_EXAMPLES),
    plot="prompt-norm.png",
)
INTEGER_ORDERS = list(range(2, 129))


def _integer_orders():
    return rdp.RdpAccountant(orders=INTEGER_ORDERS)


class NormReportingClient(PromptFLClient):
    """PromptFL whose train replies also say how large the uploaded prompt is."""

    def train(self, arrays, instruction):
        reply = super().train(arrays, instruction)
        return reply.with_metrics({PROMPT_NORM.name: float(reply.arrays[CTX].norm())})


@pytest.fixture
def registered():
    spec = dataclasses.replace(
        METHODS["promptfl"], name="promptfl-norm", client_path=f"{__name__}:NormReportingClient", metrics=(PROMPT_NORM,)
    )
    register_method(spec)
    register_accountant(Accountant("rdp-integer", "dp-accounting's RDP at integer orders only", _integer_orders))
    yield spec
    del METHODS[spec.name], METRICS[PROMPT_NORM.name], ACCOUNTANTS["rdp-integer"]


def test_a_new_figure_and_a_new_accountant_are_one_registration_each(registered, make_cfg, pretrained_clip):
    with pytest.raises(ConfigError, match="accepted values: 'rdp', 'pld', 'rdp-integer'"):
        make_cfg(method="promptfl-norm", privacy__accountant="rdp-integr")
    with pytest.raises(ReplyRejected, match="expected in \\[0, 1e\\+06\\]"):
        check_metric(PROMPT_NORM.name, -1.0, TRAIN)
    with pytest.raises(ValueError, match="already declared differently"):
        register_method(
            dataclasses.replace(registered, name="other", metrics=(dataclasses.replace(PROMPT_NORM, plot=""),))
        )

    n = 3
    cfg = make_cfg(
        method="promptfl-norm",
        num_server_rounds=2,
        max_per_class=6,
        privacy__epsilon=2.0,
        privacy__accountant="rdp-integer",
    )
    grid = InProcessGrid(client_app, [{"partition-id": i, "num-partitions": n} for i in range(n)], cfg.as_dict())
    rec = execute(cfg, grid, run_id="registries")
    data = json.loads(rec.path.read_text())
    assert data["run"]["status"] == "finished"

    # validated and recorded: every node's figure kept, the round's figure their weighted mean
    for r in data["rounds"]:
        per_node = [c["train/prompt-norm"] for c in r["clients"].values()]
        assert len(per_node) == n and not r.get("refused_metrics")
        assert min(per_node) <= r["metrics"]["prompt-norm"] <= max(per_node)
    with (rec.dir / "rounds.csv").open() as fh:
        rows = [row for row in csv.DictReader(fh) if row["client"] == ""]  # the rounds' rows, not the nodes'
    assert [float(row["prompt-norm"]) for row in rows] == [r["metrics"]["prompt-norm"] for r in data["rounds"]]

    # the accountant planned and reported the run: its epsilon is dp-accounting's at those orders
    ledger = data["privacy"]
    assert ledger["settings"]["accountant"] == "rdp-integer"
    plan = next(iter(next(iter(ledger["client_mechanisms"].values())).values()))
    assert plan["accountant"] == "rdp-integer"
    event = GaussianReleases(plan["sigma"] / plan["true_sensitivity"], plan["releases"], plan["sampling_rate"]).event()
    independent = _integer_orders().compose(event).get_epsilon(plan["delta"])
    assert plan["planned_epsilon"] == pytest.approx(independent, rel=1e-9) and independent <= 2.0 * (1 + 1e-9)
    assert data["rounds"][-1]["metrics"][EPSILON_SPENT] == pytest.approx(ledger["rounds"][-1]["epsilon"])

    # plotted: the figure in its own plot, the epsilon in the privacy plot that names the accountant
    assert data["run"]["plots"]["prompt-norm.png"] == ["prompt-norm"]
    assert data["run"]["plots"]["privacy.png"][0] == EPSILON_SPENT
    assert (rec.dir / "prompt-norm.png").stat().st_size > 1000 and (rec.dir / "privacy.png").exists()
