"""A client's ``evaluate`` only evaluates (docs/architecture.md, "Who owns what": a client): it
changes nothing a message persists and publishes nothing; the ClientApp's handler commits what the
node keeps (a first contact's private parts) and, on the run's last evaluation, publishes the
node's model on its own disk. Real clients on the embedded tiny CLIP."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from fedvlm.client_app.app import app as client_app
from fedvlm.client_app.state import PRIVATE
from fedvlm.protocol import EvaluateInstruction
from fedvlm.spec import spec_of
from fedvlm.tensor_names import CTX, GLOBAL_CTX

NODE = {"partition-id": 0, "num-partitions": 2}
SENT = {"coop": CTX, "dpfpl": GLOBAL_CTX, "pfedmoap": CTX}  # the tensor each method's evaluation is sent


def _snapshot(state: RecordDict) -> dict:
    out = {}
    for key, record in state.items():
        if isinstance(record, ArrayRecord):
            out[key] = {k: v.clone() for k, v in record.to_torch_state_dict().items()}
        else:
            out[key] = dict(record)
    return out


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if x.keys() != y.keys():
            return False
        if any(isinstance(v, torch.Tensor) and not torch.equal(v, y[k]) for k, v in x.items()):
            return False
    return True


@pytest.mark.parametrize("method", sorted(SENT))
def test_evaluate_only_evaluates_and_the_handler_commits_and_publishes(method, make_cfg, pretrained_clip, tmp_path):
    cfg = make_cfg(method=method, num_server_rounds=1, max_per_class=8)
    width = pretrained_clip.model.token_embedding.weight.shape[1]
    ctx = np.random.default_rng(0).normal(0, 0.02, (cfg.prompt.n_ctx, width)).astype(np.float32)
    instruction = EvaluateInstruction(1, final_round=True, run_dir=str(tmp_path))

    # the client alone, at its first contact: figures, and nothing kept or written
    state = RecordDict()
    node = spec_of(cfg).family.node_data(cfg, dict(NODE))
    client = spec_of(cfg).client(cfg, node, state, 1, None)
    reply = client.evaluate({SENT[method]: torch.from_numpy(ctx)}, instruction)
    assert reply.num_examples > 0 and 0.0 <= reply.metrics["local-acc"] <= 1.0
    assert _same(_snapshot(state), {}), "evaluate wrote the node's state"
    assert not (tmp_path / "published").exists(), "evaluate published"

    # through the ClientApp: the handler commits what the first contact set up, and publishes
    context = Context(run_id=1, node_id=7, node_config=dict(NODE), state=RecordDict(), run_config=cfg.as_dict())
    content = RecordDict(
        {"arrays": ArrayRecord({SENT[method]: Array(ctx)}), "config": ConfigRecord(instruction.to_config())}
    )
    answer = client_app(Message(content, dst_node_id=7, message_type=MessageType.EVALUATE), context)
    assert not answer.has_error(), answer.error.reason
    assert dict(answer.content["metrics"])["local-acc"] == pytest.approx(reply.metrics["local-acc"])
    kept = _snapshot(context.state).get(PRIVATE, {})
    if method == "pfedmoap":
        assert kept == {}  # its gate starts at its first round with experts, not at an evaluation
    else:
        assert kept, "the first contact's private parts were not committed"
    (published,) = (tmp_path / "published").glob("*.pt")
    saved = torch.load(published, weights_only=False)
    assert saved["method"] == method and saved["round"] == 1 and "ctx" in saved["prompts"]
