"""Checks on every client reply before the server uses it.

A reply is used only if it carries exactly the tensors the server expects from that node
this round, each checked from its header before a byte of it is decoded (serialised as a NumPy
array, float32, the expected shape, no more bytes than that takes), then decoded and checked
again (the header inside the bytes agrees, finite values); metrics in a MetricRecord, each a
metric declared for that reply (``fedvlm.metrics``), a finite number in its kind's range (an
accuracy in [0, 1], a count a non-negative integer, ...); and, for training, an integer
``num-examples`` between 1 and the training records the node reported in its handshake (a
client cannot claim more weight than its data). Anything else raises ``ReplyRejected`` with
the reason; the strategy drops that reply, logs and records the reason, and the round goes on.

How far an update may move the model is checked after this, by the layer around the strategy
that bounds it (``strategies.reply_bound``)."""

from __future__ import annotations

import io
import math
import re
from collections.abc import Collection, Iterable, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord

from fedvlm.metrics import EVALUATE, NUM_EXAMPLES, TRAIN, reply_metric
from fedvlm.privacy.mechanisms import NOISE_SOURCES
from fedvlm.protocol import (
    ARRAYS_RECORD,
    EVALUATION,
    FAILED,
    HELLO_NUMBERS,
    HELLO_WORDS,
    INFO_RECORD,
    METRICS_RECORD,
    EvaluateReply,
    HelloReport,
    TrainReply,
)


class ReplyRejected(ValueError):
    pass


def record_nbytes(arrays: Mapping[str, np.ndarray]) -> int:
    """Payload size: the bytes of the tensors themselves (not protocol framing)."""
    return int(sum(np.asarray(a).nbytes for a in arrays.values()))


NPY_HEADER_MAX = 4096  # a .npy header is a few hundred bytes; a float32 payload's size is known


def check_metric(name: str, value, message: str) -> None:
    """``ReplyRejected`` unless ``value`` is what metric ``name`` may be in a ``message`` reply
    (``fedvlm.metrics``: declared for that reply, a finite number in its kind's range)."""
    metric = reply_metric(name, message)
    why = metric if isinstance(metric, str) else metric.check(value)
    if why is not None:
        raise ReplyRejected(why)


def decode_tensor(name: str, array: Array, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor ``name`` of a reply, checked from its header before its bytes are decoded."""
    if not isinstance(array, Array):
        raise ReplyRejected(f"tensor {name!r} is a {type(array).__name__}, expected a Flower Array")
    if array.stype != "numpy.ndarray":
        raise ReplyRejected(f"tensor {name!r} is serialised as {array.stype!r}, expected 'numpy.ndarray'")
    if array.dtype != "float32":
        raise ReplyRejected(f"tensor {name!r} has dtype {array.dtype}, expected float32")
    if tuple(array.shape) != tuple(shape):
        raise ReplyRejected(f"tensor {name!r} has shape {tuple(array.shape)}, expected {tuple(shape)}")
    most = 4 * math.prod(shape) + NPY_HEADER_MAX
    if len(array.data) > most:
        raise ReplyRejected(f"tensor {name!r} holds {len(array.data):,} bytes, more than the {most:,} its shape takes")
    try:
        value = np.load(io.BytesIO(array.data), allow_pickle=False)
    except Exception as err:  # noqa: BLE001 - whatever the bytes are, they are not a NumPy array
        why = str(err).split(". ")[0]
        raise ReplyRejected(f"tensor {name!r}: its bytes are not a NumPy array ({type(err).__name__}: {why})") from err
    if not isinstance(value, np.ndarray) or value.dtype != np.float32 or tuple(value.shape) != tuple(shape):
        got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, np.ndarray) else type(value).__name__
        raise ReplyRejected(f"tensor {name!r}: its bytes hold {got}, not the float32 {tuple(shape)} its header says")
    if not np.isfinite(value).all():
        raise ReplyRejected(f"tensor {name!r} holds {int((~np.isfinite(value)).sum())} NaN/Inf values")
    return value


def _failed(msg: Message, part: str) -> None:
    """``ReplyRejected`` where the node reports ``part`` ('train', 'evaluation') failed: an error
    reply, or the part of a train message that carried an evaluation (``protocol.FAILED``)."""
    if msg.has_error():
        raise ReplyRejected(f"the client failed: {short_reason(msg.error.reason)}")
    failed = msg.content.get(FAILED)
    if isinstance(failed, ConfigRecord) and part in failed:
        raise ReplyRejected(f"the client failed: {short_reason(str(failed[part]))}")


def _records(
    msg: Message, expected: Mapping[str, tuple[int, ...]], layers: Collection[str] = ()
) -> tuple[dict[str, np.ndarray], dict]:
    """A reply's tensors (exactly ``expected``, each checked from its header before it is decoded)
    and its metrics record, or ``ReplyRejected``."""
    _failed(msg, "train")
    content = msg.content
    tensors = ArrayRecord()
    if ARRAYS_RECORD in content:
        record = content[ARRAYS_RECORD]
        if not isinstance(record, ArrayRecord):
            raise ReplyRejected(f"{ARRAYS_RECORD!r} is a {type(record).__name__}, expected an ArrayRecord")
        tensors = record
    names = set(tensors.keys()) - set(layers)
    missing = set(expected) - names
    extra = names - set(expected)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {some_names(missing)}")
        if extra:
            parts.append(f"unexpected {some_names(extra)}")
        raise ReplyRejected("wrong tensors: " + "; ".join(parts))
    arrays = {name: decode_tensor(name, tensors[name], shape) for name, shape in expected.items()}
    return arrays, _metrics(content, METRICS_RECORD)


def _metrics(content, key: str) -> dict:
    """A reply's metrics record ``key`` (none: no metrics), or ``ReplyRejected``."""
    if key not in content:
        return {}
    record = content[key]
    if not isinstance(record, MetricRecord):
        raise ReplyRejected(f"{key!r} is a {type(record).__name__}, expected a MetricRecord")
    return dict(record)


def _count(metrics: Mapping, least: int) -> None:
    n = metrics.get(NUM_EXAMPLES)
    if not isinstance(n, int) or isinstance(n, bool) or n < least:
        kind = "positive" if least > 0 else "non-negative"
        raise ReplyRejected(f"metric {NUM_EXAMPLES!r} must be a {kind} integer, got {n!r}")


def _figures(metrics: Mapping, message: str, most: Mapping[str, int] | None = None) -> tuple[dict, dict[str, str]]:
    """(the metrics of a ``message`` reply the server accepts, {refused metric: why}). A metric the server cannot accept
    costs that metric, never the reply: whether a figure is acceptable can depend on the private
    data (a round whose Poisson batches were all empty once reported a NaN loss), and a reply
    kept or dropped by the data would move the aggregate by a node's whole upload instead of one
    record's bounded share, which the accounting does not cover."""
    kept, refused = {}, {}
    for k, v in metrics.items():
        try:
            if k != NUM_EXAMPLES:
                check_metric(k, v, message)
            if most is not None and k in most and v > most[k]:
                raise ReplyRejected(f"metric {k!r} is {v!r}, more than the {most[k]} records its handshake reported")
            kept[k] = v
        except ReplyRejected as why:
            refused[k] = str(why)
    return kept, refused


def check_train_reply(
    msg: Message, expected: Mapping[str, tuple[int, ...]], max_examples: int = 0, layers: Iterable[str] = ()
) -> tuple[TrainReply, dict[str, str]]:
    """(the train reply as a ``TrainReply``, its tensors decoded and its unacceptable metrics left
    out; {refused metric: why}), or ``ReplyRejected``: it must hold exactly the ``expected``
    tensors and a positive integer ``num-examples`` (the node's training records, the same every
    round: not the round's batches), at most ``max_examples`` (> 0: the records it reported).
    ``layers``: tensors a layer around the strategy reads and checks itself (secure aggregation's
    masked vector), left out here."""
    arrays, metrics = _records(msg, expected, frozenset(layers))
    _count(metrics, 1)
    n = metrics[NUM_EXAMPLES]
    if max_examples and n > max_examples:
        raise ReplyRejected(f"it claims num-examples = {n}, more than the {max_examples} training records it reported")
    kept, refused = _figures(metrics, TRAIN)
    return TrainReply.from_records(arrays, kept), refused


def check_evaluate_reply(
    msg: Message, carried: bool = False, most: Mapping[str, int] | None = None
) -> tuple[EvaluateReply, dict[str, str]]:
    """(the evaluate reply as an ``EvaluateReply``, its unacceptable metrics left out; {refused
    metric: why}), or ``ReplyRejected``: metrics only, a ``num-examples`` (where given) a
    non-negative integer. ``carried``: the evaluation came in a train message, whose reply holds
    its metrics in the ``evaluation`` record (``protocol.EVALUATION``). ``most``: the largest
    value of each record count (``num-examples``, ``local-n``, ...) the node's handshake allows: a
    count past it would weight the federation's accuracy by a lie (one node claiming 10^15 test
    records set the weighted accuracy to its own); a ``num-examples`` past it rejects the reply,
    another count is left out."""
    if carried:
        _failed(msg, "evaluation")
        if EVALUATION not in msg.content:
            raise ReplyRejected(f"it lacks the {EVALUATION!r} record of the evaluation its message carried")
        metrics = _metrics(msg.content, EVALUATION)
    else:
        _, metrics = _records(msg, {})
    if NUM_EXAMPLES in metrics:
        _count(metrics, 0)
        if most is not None and NUM_EXAMPLES in most and metrics[NUM_EXAMPLES] > most[NUM_EXAMPLES]:
            raise ReplyRejected(
                f"it claims num-examples = {metrics[NUM_EXAMPLES]}, more than the {most[NUM_EXAMPLES]} test records it "
                "reported"
            )
    kept, refused = _figures(metrics, EVALUATE, most)
    return EvaluateReply.from_records(kept), refused


NAME = re.compile(r"^[\w.@+-]{1,64}$")
# a node's description (its sizes, backbone, dataset, class ids, ...) is kept in results.json: an
# honest one, with 10,000 class ids, holds under 60,000 characters (its fields are protocol's)
HELLO_CHARS = 131_072


def check_hello(msg: Message) -> HelloReport:
    """A node's handshake reply as a ``HelloReport``, or ``ReplyRejected`` naming what is wrong:
    its records (a name of letters, digits and ``._@+-``; sizes that are integers, at least one
    training record, at least one class; a partition id from -1)."""
    if msg.has_error():
        raise ReplyRejected(short_reason(msg.error.reason))
    content = msg.content
    info, metrics = content.get(INFO_RECORD), content.get(METRICS_RECORD)
    if not isinstance(info, ConfigRecord) or not isinstance(metrics, MetricRecord):
        raise ReplyRejected(
            f"its handshake lacks the {INFO_RECORD!r} ConfigRecord or the {METRICS_RECORD!r} MetricRecord it must carry"
        )
    unknown = sorted({*info} - set(HELLO_WORDS.values()) | {*metrics} - {k for k, _ in HELLO_NUMBERS.values()})
    if unknown:
        raise ReplyRejected(f"its handshake carries fields no node of this project reports: {', '.join(unknown)[:200]}")
    for key, least in HELLO_NUMBERS.values():
        value = metrics.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ReplyRejected(f"its handshake reports {key} = {value!r}; expected an integer of at least {least}")
    if not all(isinstance(v, str) for v in info.values()):
        raise ReplyRejected("its handshake's words are not all text")
    for key in (HELLO_WORDS["name"], HELLO_WORDS["backbone"]):
        if not info.get(key):
            raise ReplyRejected(f"its handshake has no {key!r}")
    source = info.get(HELLO_WORDS["noise_source"])
    if source not in NOISE_SOURCES:
        raise ReplyRejected(
            f"its handshake reports noise-source = {source if source is None else str(source)[:40]!r}; expected one "
            f"of {', '.join(NOISE_SOURCES)}"
        )
    name = str(info[HELLO_WORDS["name"]])
    if not NAME.match(name):
        raise ReplyRejected(f"its name {name[:80]!r} is not 1-64 letters, digits or ._@+-")
    size = sum(len(str(k)) + len(str(v)) for record in (info, metrics) for k, v in record.items())
    if size > HELLO_CHARS:
        raise ReplyRejected(
            f"its handshake carries {size:,} characters, more than the {HELLO_CHARS:,} a node's description takes"
        )
    return HelloReport.from_records(dict(info), dict(metrics))


_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): (.+)$")
# What a node says is kept at most this long wherever the server records or logs it: a 5 MB
# error reason, or 2,000 made-up tensor names, once grew results.json and the log to 28 MB in 3
# rounds. The bound is on what a node controls; the server's own words around it are short.
REASON_CHARS = 500
NAMES_SHOWN = 8


def bounded(text: str, limit: int = REASON_CHARS) -> str:
    """``text``, cut to ``limit`` characters with its full length said."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def some_names(names: Collection[str]) -> str:
    """Up to ``NAMES_SHOWN`` of ``names`` (each cut to 32 characters, so that the count of the
    rest survives a dropped reply's bounded reason), sorted, and how many there were."""
    shown = ", ".join(bounded(n, 32) for n in sorted(names)[:NAMES_SHOWN])
    return shown if len(names) <= NAMES_SHOWN else f"{shown} and {len(names) - NAMES_SHOWN:,} more"


def short_reason(reason: str | None) -> str:
    """The useful line of a client's error, at most ``REASON_CHARS`` long. Flower passes whole
    tracebacks (wrapped by Ray in simulation); keep the last ``SomeError: message`` line of the
    original exception."""
    lines = [ln.strip() for ln in (reason or "").strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        m = _EXC_LINE.match(ln)
        if m and not m.group(1).endswith("ClientAppException"):
            return bounded(f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2)}".rstrip("'>"))
    return bounded(lines[-1]) if lines else "unknown error"
