"""The runtime guard on outgoing tensors."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from fedvlm.client_app.send_guard import PrivacyGuardError, check_outgoing, guarded_reply
from fedvlm.metrics import NUM_EXAMPLES
from fedvlm.protocol import EVALUATION, EvaluateReply, TrainReply


def test_allowed_tensor_passes_and_is_sent():
    req = Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=1, message_type=MessageType.TRAIN)
    reply = guarded_reply(req, TrainReply({"ctx": torch.ones(2, 3)}, {NUM_EXAMPLES: 5}), allowed={"ctx"})
    assert list(reply.content["arrays"].keys()) == ["ctx"] and reply.content["metrics"][NUM_EXAMPLES] == 5


def test_undeclared_tensor_is_refused():
    with pytest.raises(PrivacyGuardError, match="'local_ctx'.*not in this method's shared set"):
        check_outgoing({"ctx": torch.ones(2), "local_ctx": torch.ones(2)}, allowed={"ctx"})


def test_nothing_may_leave_a_local_only_method():
    with pytest.raises(PrivacyGuardError, match="nothing may be shared"):
        check_outgoing({"ctx": torch.ones(2)}, allowed=set())


def test_private_content_under_a_shared_name_is_refused():
    private = {"ctx": torch.arange(6.0).reshape(2, 3)}
    with pytest.raises(PrivacyGuardError, match="equals the private tensor 'ctx'"):
        check_outgoing({"shared": private["ctx"].clone()}, allowed={"shared"}, private=private)
    check_outgoing({"shared": private["ctx"] + 1}, allowed={"shared"}, private=private)


def test_only_what_the_server_asked_for():
    with pytest.raises(PrivacyGuardError, match="asked this client only for lora_A"):
        check_outgoing(
            {"lora_A": torch.ones(1), "lora_B": torch.ones(1)}, allowed={"lora_A", "lora_B"}, requested=["lora_A"]
        )


def test_a_carried_evaluation_leaves_as_metrics_beside_the_training():
    request = Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=3, message_type=MessageType.TRAIN)
    reply = guarded_reply(
        request,
        TrainReply({"shared": torch.ones(2)}, {NUM_EXAMPLES: 4}),
        allowed={"shared"},
        evaluation=EvaluateReply({NUM_EXAMPLES: 2, "local-acc": 0.5}),
    )
    assert dict(reply.content[EVALUATION]) == {NUM_EXAMPLES: 2, "local-acc": 0.5}
    assert dict(reply.content["metrics"]) == {NUM_EXAMPLES: 4} and list(reply.content["arrays"]) == ["shared"]


def test_a_metric_the_catalogue_does_not_declare_never_leaves_and_is_not_named():
    request = Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=3, message_type=MessageType.TRAIN)
    smuggled = {NUM_EXAMPLES: 4, "label-of-record-17-is-3": 1.0}
    with pytest.raises(PrivacyGuardError, match="does not declare for train replies") as refused:
        guarded_reply(request, TrainReply({"shared": torch.ones(2)}, smuggled), allowed={"shared"})
    assert "record-17" not in str(refused.value)
    with pytest.raises(PrivacyGuardError, match="for evaluate replies"):  # an evaluation's figures too
        guarded_reply(
            request,
            TrainReply({"shared": torch.ones(2)}, {NUM_EXAMPLES: 4}),
            allowed={"shared"},
            evaluation=EvaluateReply({NUM_EXAMPLES: 2, "train-acc": 0.5}),  # a train figure in an evaluation
        )
