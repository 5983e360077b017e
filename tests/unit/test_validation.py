"""Reply validation on real Flower messages."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict

from fedvlm.protocol import EVALUATION, FAILED, SERVER_ROUND, EvaluateReply, TrainReply
from fedvlm.strategies.reply_bound import clipped, norm_bound, update_norm
from fedvlm.strategies.validation import ReplyRejected, check_evaluate_reply, check_train_reply


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
    reply, refused = check_train_reply(_reply({"ctx": np.zeros((4, 8), np.float32)}), EXPECTED)
    assert refused == {} and isinstance(reply, TrainReply)
    assert reply.arrays["ctx"].shape == (4, 8) and reply.num_examples == 10 and reply.metrics["num-examples"] == 10


def test_an_evaluate_reply_carries_no_tensor_and_may_count_nothing():
    reply, _ = check_evaluate_reply(_reply(metrics={"num-examples": 0, "local-acc": 0.5, "compute-seconds": 0.25}))
    assert isinstance(reply, EvaluateReply) and reply.arrays == {}
    assert (reply.num_examples, reply.compute_seconds, reply.metrics["local-acc"]) == (0, 0.25, 0.5)
    with pytest.raises(ReplyRejected, match="unexpected ctx"):
        check_evaluate_reply(_reply({"ctx": np.zeros((4, 8), np.float32)}))
    with pytest.raises(ReplyRejected, match="non-negative integer, got -1"):
        check_evaluate_reply(_reply(metrics={"num-examples": -1}))


@pytest.mark.parametrize(
    "arrays,metrics,match",
    [
        ({"ctx": np.zeros((4, 9), np.float32)}, None, "shape"),
        ({}, None, "missing ctx"),
        ({"ctx": np.zeros((4, 8), np.float32), "local": np.zeros(3, np.float32)}, None, "unexpected local"),
        ({"ctx": np.full((4, 8), np.nan, np.float32)}, None, "NaN"),
        ({"ctx": np.zeros((4, 8), np.int64)}, None, "dtype"),
        ({"ctx": np.zeros((4, 8), np.float32)}, {"num-examples": 0}, "num-examples"),
        ({"ctx": np.zeros((4, 8), np.float64)}, None, "float64, expected float32"),
        ({"ctx": np.zeros((4, 8), np.float32)}, {"num-examples": 11}, "num-examples = 11, more than the 10"),
        ({"ctx": np.zeros((4, 8), np.float32)}, {"num-examples": 2.5}, "positive integer, got 2.5"),
        ({"ctx": np.zeros((4, 8), np.float32)}, {}, "positive integer, got None"),
    ],
)
def test_bad_replies_are_rejected_with_reason(arrays, metrics, match):
    with pytest.raises(ReplyRejected, match=match):
        check_train_reply(_reply(arrays, metrics), EXPECTED, max_examples=10)


@pytest.mark.parametrize(
    "bad,why",
    [
        ({"train-loss": float("nan")}, "finite number"),
        ({"train-loss": float("inf")}, "finite number"),
        ({"train-loss": [1.0, 2.0]}, "finite number"),
        ({"train-acc": 1.5}, "expected in [0, 1]"),
        ({"made-up": 1.0}, "not one this project's clients report"),
        ({"local-acc": 0.5}, "not one a train reply carries"),  # an evaluation's figure
    ],
)
def test_a_metric_the_server_cannot_accept_costs_that_metric_not_the_reply(bad, why):
    """Whether a figure is acceptable can depend on the private data (an all-empty Poisson round
    once reported a NaN loss): the reply, and so the aggregate, must not."""
    reply, refused = check_train_reply(
        _reply({"ctx": np.ones((4, 8), np.float32)}, {"num-examples": 3, "local-steps": 2, **bad}), EXPECTED
    )
    assert reply.metrics == {"num-examples": 3, "local-steps": 2} and reply.arrays["ctx"].sum() == 32
    assert set(refused) == set(bad) and why in next(iter(refused.values()))


def test_metrics_must_be_numbers_in_a_metric_record():
    msg = _reply({"ctx": np.zeros((4, 8), np.float32)})
    msg.content["metrics"] = ConfigRecord({"num-examples": 5, "train-loss": "low"})
    with pytest.raises(ReplyRejected, match="ConfigRecord, expected a MetricRecord"):
        check_train_reply(msg, EXPECTED)


def test_an_update_is_what_the_reply_changes_and_clipping_scales_only_that():
    sent = {"ctx": np.ones((2, 2), np.float32)}
    reply = {"ctx": np.full((2, 2), 4.0, np.float32), "grad": np.full(2, 2.0, np.float32)}
    # ctx moved by 3 in four entries (norm 6), the gradient was not sent (norm sqrt(8))
    assert update_norm(sent, reply) == pytest.approx(np.sqrt(36 + 8))
    half = clipped(sent, reply, 0.5)
    assert np.allclose(half["ctx"], 2.5) and np.allclose(half["grad"], 1.0) and half["ctx"].dtype == np.float32
    assert update_norm(sent, half) == pytest.approx(0.5 * np.sqrt(44))
    # a finite float32 update whose norm overflows float32 is measured in float64
    assert np.isfinite(update_norm({}, {"x": np.full(4, 3e38, np.float32)}))


def test_the_bound_is_a_multiple_of_the_lower_median_or_the_absolute_one():
    assert norm_bound([1.0, 1e12], 10, 0) == 10.0  # one honest and one hostile reply: the honest one sets it
    assert norm_bound([1.0, 2.0, 3.0, 1e9], 10, 0) == 20.0
    assert norm_bound([1.0, 2.0, 3.0], 10, 5.0) == 5.0
    assert norm_bound([0.0, 0.0, 7.0], 10, 0) == float("inf")  # no movement to compare against
    assert norm_bound([3.0], 0, 0) == float("inf")


def test_error_reply_is_rejected():
    err = Message(Error(code=3, reason="CUDA out of memory"), reply_to=_request())
    with pytest.raises(ReplyRejected, match="out of memory"):
        check_train_reply(err, EXPECTED)


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


def test_an_evaluation_carried_by_a_train_message_is_read_from_its_own_record():
    reply = _reply({"ctx": np.zeros((4, 8), np.float32)})
    reply.content[EVALUATION] = MetricRecord({"num-examples": 3, "local-acc": 0.75})
    carried, _ = check_evaluate_reply(reply, carried=True)
    assert carried.arrays == {} and carried.metrics == {"num-examples": 3, "local-acc": 0.75}
    # the train reply's own tensors and metrics are the training's, not the evaluation's
    assert check_train_reply(reply, EXPECTED)[0].metrics == {"num-examples": 10}
    with pytest.raises(ReplyRejected, match="lacks the 'evaluation' record"):
        check_evaluate_reply(_reply({"ctx": np.zeros((4, 8), np.float32)}), carried=True)
    bad = _reply()
    bad.content[EVALUATION] = MetricRecord({"local-acc": 7.0})
    kept, refused = check_evaluate_reply(bad, carried=True)
    assert kept.metrics == {} and "expected in" in refused["local-acc"]


def test_a_failed_part_of_a_train_message_fails_that_part_only():
    reply = _reply()
    reply.content[FAILED] = ConfigRecord({"train": "PrivacyFloorError: round 3 would pass this node's limit"})
    reply.content[EVALUATION] = MetricRecord({"num-examples": 3, "local-acc": 0.75})
    with pytest.raises(ReplyRejected, match="the client failed: PrivacyFloorError: round 3 would pass"):
        check_train_reply(reply, {})
    assert check_evaluate_reply(reply, carried=True)[0].metrics["local-acc"] == 0.75
    reply.content[FAILED] = ConfigRecord({"evaluation": "RuntimeError: out of memory"})
    with pytest.raises(ReplyRejected, match="out of memory"):
        check_evaluate_reply(reply, carried=True)


def test_evaluation_counts_are_bounded_by_the_handshake():
    most = {"num-examples": 5, "local-n": 5, "neighbor-n": 2}
    reply, refused = check_evaluate_reply(
        _reply(metrics={"num-examples": 5, "local-n": 5, "neighbor-n": 3, "local-acc": 0.5}), most=most
    )
    assert reply.metrics == {"num-examples": 5, "local-n": 5, "local-acc": 0.5} and list(refused) == ["neighbor-n"]
    with pytest.raises(ReplyRejected, match="num-examples = 6, more than the 5 test records"):
        check_evaluate_reply(_reply(metrics={"num-examples": 6}), most=most)


def test_what_a_node_says_is_recorded_in_a_few_hundred_characters():
    """A 5 MB error reason or 2,000 made-up tensor names once grew results.json to 28 MB in 3 rounds."""
    from fedvlm.protocol import HelloReport
    from fedvlm.strategies.validation import check_hello

    err = Message(Error(code=0, reason="Traceback ...\nRuntimeError: " + "x" * 5_000_000), reply_to=_request())
    with pytest.raises(ReplyRejected) as caught:
        check_train_reply(err, EXPECTED)
    assert len(str(caught.value)) < 600 and str(caught.value).endswith("(5,000,014 characters)")
    made_up = {f"t{i:04d}" + "y" * 300: np.zeros(1, np.float32) for i in range(2000)}
    made_up["ctx"] = np.zeros((4, 8), np.float32)
    with pytest.raises(ReplyRejected, match=r"unexpected t0000y+\.\.\. \(305 characters\), .* 1,992 more$") as caught:
        check_train_reply(_reply(made_up), EXPECTED)
    assert len(str(caught.value)) < 1000
    hello = HelloReport("org-0", -1, 10, 2, 0, 3, "clip", "os", dataset="d" * 200_000)
    info, metrics = hello.to_records()
    msg = Message(RecordDict({"info": ConfigRecord(info), "metrics": MetricRecord(metrics)}), reply_to=_request())
    with pytest.raises(ReplyRejected, match="more than the 131,072 a node's description takes"):
        check_hello(msg)
    made_up = {**info, **{f"k{i:03d}" + "z" * 100: "v" for i in range(100)}}
    msg = Message(RecordDict({"info": ConfigRecord(made_up), "metrics": MetricRecord(metrics)}), reply_to=_request())
    with pytest.raises(ReplyRejected, match="fields no node of this project reports: k000z+") as caught:
        check_hello(msg)
    assert len(str(caught.value)) < 300


def test_a_handshake_is_typed_both_ways_and_states_its_noise_source():
    """Issue 46: the handshake's words were a free dict and a missing noise-source read as
    'seeded'; now every field is typed, spelled once (protocol.HELLO_WORDS, HELLO_NUMBERS), and a
    node that does not say where its noise comes from is not admitted."""
    from fedvlm.protocol import HELLO_WORDS, HelloReport
    from fedvlm.strategies.validation import check_hello

    hello = HelloReport("org-0", -1, 10, 2, 0, 3, "clip", "os", dataset="own", class_list="ab12", num_partitions=0)
    info, metrics = hello.to_records()
    assert (
        check_hello(
            Message(RecordDict({"info": ConfigRecord(info), "metrics": MetricRecord(metrics)}), reply_to=_request())
        )
        == hello
    )
    for source in (None, "dice"):
        words = {k: v for k, v in info.items() if k != HELLO_WORDS["noise_source"]}
        if source:
            words[HELLO_WORDS["noise_source"]] = source
        msg = Message(RecordDict({"info": ConfigRecord(words), "metrics": MetricRecord(metrics)}), reply_to=_request())
        with pytest.raises(ReplyRejected, match=f"noise-source = {source!r}; expected one of seeded, os"):
            check_hello(msg)
