"""A reply counts whatever the private data: a node whose Poisson batches were all empty still
sends its clipped upload and the server keeps it, so on every neighbouring pair (one record in
or out of a node's batch) the global-DP methods' aggregate moves by at most one record's C/B
over the denominator, at every batch size (the issue 44 finding: at B=2 a node's round was empty
with probability 0.13, its NaN loss dropped the whole reply, and FedPGP's upload, which carries
the contrastive term's gradient added after clipping, then moved the average 16x that bound)."""

from __future__ import annotations

import numpy as np
import pytest

from fedvlm.client_app import trainer
from fedvlm.client_app.app import app as client_app
from fedvlm.server_app.app import execute
from fedvlm.spec import spec_of
from fedvlm.tensor_names import GLOBAL_GRAD
from fedvlm.utils.inprocess import InProcessGrid
from tests.neighbours import one_record_batches

GLOBAL_DP_METHODS = ("dpfpl", "fedotp", "fedpgp")


def _round(cfg, world: str) -> tuple[dict, dict[int, np.ndarray]]:
    """One round on two nodes (sizes 3:1). Partition 0's one local step samples its record 0
    alone (``world`` 'in') or nothing ('out'); the other node samples as usual. Returns the
    round's record and each node's uploaded global-prompt gradient, by node id."""
    sizes = [
        len(spec_of(cfg).family.node_data(cfg, {"partition-id": i, "num-partitions": 2}).part.train) for i in (0, 1)
    ]
    honest, batches = trainer.batches, one_record_batches(world, sizes[0], sizes[1:])
    uploads: dict[int, np.ndarray] = {}

    def keep(req, reply):
        if req.metadata.message_type == "train" and not reply.has_error():
            uploads[req.metadata.dst_node_id] = reply.content["arrays"][GLOBAL_GRAD].numpy().copy()
        return reply

    grid = InProcessGrid(
        client_app, [{"partition-id": i, "num-partitions": 2} for i in range(2)], cfg.as_dict(), intercept=keep
    )
    trainer.batches = batches
    try:
        (record,) = execute(cfg, grid, run_id=f"pair-{world}").data["rounds"]
    finally:
        trainer.batches = honest
    return record, uploads


# B = 1 and 8 in the default selection; every B between them with -m slow (a pair is two runs)
PAIRS = [
    pytest.param(m, b, marks=() if b in (1, 8) else pytest.mark.slow, id=f"{m}-B{b}")
    for m in GLOBAL_DP_METHODS
    for b in range(1, 9)
]


@pytest.mark.parametrize("method,b", PAIRS)
def test_an_empty_round_is_kept_and_one_record_moves_the_upload_by_at_most_c_over_b(
    method, b, make_cfg, pretrained_clip, tmp_path
):
    cfg = make_cfg(
        method=method,
        privacy__epsilon=1.0,
        num_server_rounds=1,
        prompt__batch_size=b,
        prompt__local_steps=1,
        partitioner="quantity-skew",
        quantity_ratios="3:1",
    )
    got = {world: _round(cfg, world) for world in ("in", "out")}
    for world, (record, uploads) in got.items():
        assert record["dropped"] == [] and record["refused_metrics"] == [], (world, record["dropped"])
        assert record["metrics"]["train-clients"] == 2 and len(uploads) == 2, world
    (node,) = [n for n in got["in"][1] if not np.array_equal(got["in"][1][n], got["out"][1][n])]
    moved = float(np.linalg.norm(got["in"][1][node].astype(np.float64) - got["out"][1][node]))
    assert 0 < moved <= cfg.privacy.clip / b * (1 + 1e-5), (moved, cfg.privacy.clip / b)
    # the node that trained on nothing says nothing about a loss, and sent its upload all the same
    assert any("train-loss" not in row for row in got["out"][0]["clients"].values())
    if method == "fedpgp":  # the contrastive term's gradient travels even when no record was sampled
        assert float(np.abs(got["out"][1][node]).sum()) > 0
