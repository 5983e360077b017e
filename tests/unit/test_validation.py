"""Reply validation on real Flower messages."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict

from fedvlm.protocol import SERVER_ROUND
from fedvlm.strategies.validation import ReplyRejected, check_reply


def _request():
    return Message(
        RecordDict({"config": ConfigRecord({SERVER_ROUND: 1})}), dst_node_id=7, message_type=MessageType.TRAIN
    )


def _reply(arrays=None, metrics=None):
    content = RecordDict()
    content["arrays"] = ArrayRecord({k: Array(v) for k, v in (arrays or {}).items()})
    content["metrics"] = MetricRecord(metrics if metrics is not None else {"num-examples": 10})
    return Message(content, reply_to=_request())


EXPECTED = {"ctx": (4, 8)}


def test_good_reply_passes():
    arrays, metrics = check_reply(_reply({"ctx": np.zeros((4, 8), np.float32)}), EXPECTED)
    assert arrays["ctx"].shape == (4, 8) and metrics["num-examples"] == 10


@pytest.mark.parametrize(
    "arrays,metrics,match",
    [
        ({"ctx": np.zeros((4, 9), np.float32)}, None, "shape"),
        ({}, None, "missing ctx"),
        ({"ctx": np.zeros((4, 8), np.float32), "local": np.zeros(3, np.float32)}, None, "unexpected local"),
        ({"ctx": np.full((4, 8), np.nan, np.float32)}, None, "NaN"),
        ({"ctx": np.zeros((4, 8), np.int64)}, None, "dtype"),
        ({"ctx": np.zeros((4, 8), np.float32)}, {"num-examples": 0}, "num-examples"),
        ({"ctx": np.zeros((4, 8), np.float32)}, {"num-examples": 3, "train-loss": float("inf")}, "train-loss"),
    ],
)
def test_bad_replies_are_rejected_with_reason(arrays, metrics, match):
    with pytest.raises(ReplyRejected, match=match):
        check_reply(_reply(arrays, metrics), EXPECTED)


def test_error_reply_is_rejected():
    err = Message(Error(code=3, reason="CUDA out of memory"), reply_to=_request())
    with pytest.raises(ReplyRejected, match="out of memory"):
        check_reply(err, EXPECTED)


def test_short_reason_keeps_the_original_exception_line():
    from fedvlm.strategies.validation import short_reason

    ray_style = (
        "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'ray::ClientAppActor.run()\n"
        '  File "client.py", line 11, in train\n    raise RuntimeError("boom")\nRuntimeError: boom\n\n'
        "The above exception was the direct cause of the following exception:\n\n"
        "flwr.clientapp.client_app.ClientAppException: \nException ClientAppException occurred. Message: boom'>"
    )
    assert short_reason(ray_style) == "RuntimeError: boom"
    assert short_reason("Traceback...\ndata.registry.DatasetError: no such folder") == "DatasetError: no such folder"
