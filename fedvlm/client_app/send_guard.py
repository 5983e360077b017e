"""The runtime guard on everything a client sends.

Every reply a ClientApp sends is built here. A tensor leaves the client only if its name is
in the method's declared shared set (``methods.MethodSpec.shared``) and, where the server
asked for a subset, in that subset too. As a second line, a tensor whose bytes equal one of
the client's private tensors is refused whatever its name, which catches a private prompt
renamed into a shared slot. A refusal raises ``PrivacyGuardError``: the reply is never
sent, the server sees a failed client, and the error names the offending tensor.

What leaves in an error's text is held here too (``public_errors``, ``public_text``): the text of
a ``fedvlm.errors.PublicError``, else only the error's class name, its text kept in the node's log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedvlm.errors import PublicError
from fedvlm.metrics import EVALUATE, TRAIN, reply_metric
from fedvlm.protocol import (
    ARRAYS_RECORD,
    EVALUATION,
    FAILED,
    INFO_RECORD,
    METRICS_RECORD,
    SECAGG_MASKED,
    SECURE_SUM,
    EvaluateReply,
    HelloReport,
    TrainReply,
)

if TYPE_CHECKING:  # torch is imported where a tensor is handled, so that a message without one starts fast
    import torch


log = logging.getLogger(__name__)


class PrivacyGuardError(PublicError, RuntimeError):
    pass


@dataclass(frozen=True)
class Guarded:
    """A train reply and what the send guard holds it to."""

    reply: TrainReply
    allowed: frozenset[str]  # the method's sharing rule over the node's model
    private: Mapping[str, Any]  # tensors that must never leave
    requested: tuple[str, ...]  # what the server named for this round


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def check_outgoing(
    arrays: Mapping[str, torch.Tensor],
    allowed: Iterable[str],
    private: Mapping[str, torch.Tensor] | None = None,
    requested: Iterable[str] | None = None,
) -> None:
    allowed = frozenset(allowed)
    for name in arrays:
        if name not in allowed:
            raise PrivacyGuardError(
                f"refusing to send tensor {name!r}: it is not in this method's shared set "
                f"({', '.join(sorted(allowed)) or 'nothing may be shared'})"
            )
    if requested is not None:
        extra = set(arrays) - set(requested)
        if extra:
            raise PrivacyGuardError(
                f"refusing to send {', '.join(sorted(extra))}: the server asked this client only for "
                f"{', '.join(sorted(requested)) or 'nothing'} this round"
            )
    for name, value in arrays.items():
        for pname, pvalue in (private or {}).items():
            if _same_bytes(value.detach().cpu(), pvalue.detach().cpu()):
                raise PrivacyGuardError(
                    f"refusing to send tensor {name!r}: its content equals the private tensor {pname!r}"
                )


def guarded_reply(
    msg: Message,
    reply: TrainReply | EvaluateReply,
    allowed: Iterable[str],
    private: Mapping[str, torch.Tensor] | None = None,
    requested: Iterable[str] | None = None,
    evaluation: EvaluateReply | Exception | None = None,
) -> Message:
    """The reply message, after ``check_outgoing`` has passed; ``evaluation``: the evaluation the
    message carried, its metrics (``protocol.EVALUATION``, no tensor) or its error."""
    arrays, metrics = reply.to_records()
    check_outgoing(arrays, allowed, private, requested)
    content = RecordDict()
    content[ARRAYS_RECORD] = ArrayRecord({k: v.detach().cpu().contiguous() for k, v in arrays.items()})
    content[METRICS_RECORD] = _metric_record(metrics, msg.metadata.message_type)
    _add_evaluation(content, evaluation, {})
    return Message(content, reply_to=msg)


def secure_reply(
    msg: Message,
    metrics: Mapping[str, float | int],
    record: Mapping,
    masked: np.ndarray | None = None,
    carried: RecordDict | None = None,
) -> Message:
    """A stage of a secure round (``client_app.secure_aggregation``): the stage's ``record``
    (``protocol.SECURE_SUM``: public keys, encrypted shares, a signature, the shares the server
    asked for), and no tensor but ``masked``, the node's vector under its masks
    (``SECAGG_MASKED``); ``carried``: the clear reply this one replaces, whose evaluation figures
    and failed parts (``protocol.EVALUATION``, ``FAILED``) go back as they were. The tensors the
    vector encodes passed ``check_outgoing`` before they were encoded."""
    content = RecordDict()
    arrays = ArrayRecord()
    if masked is not None:
        if masked.dtype not in (np.uint32, np.uint64) or masked.ndim != 1:
            raise PrivacyGuardError("a secure round sends one flat vector of residues (uint32/64), nothing else")
        arrays[SECAGG_MASKED] = Array(np.ascontiguousarray(masked))
    content[ARRAYS_RECORD] = arrays
    content[METRICS_RECORD] = _metric_record(metrics, TRAIN)
    content[SECURE_SUM] = ConfigRecord(dict(record))
    for key in (EVALUATION, FAILED):
        if carried is not None and key in carried:
            content[key] = carried[key]
    return Message(content, reply_to=msg)


def failed_reply(msg: Message, error: Exception, evaluation: EvaluateReply | Exception | None) -> Message:
    """The reply to a train message whose training failed (``error``; no tensor leaves) and that
    carried an evaluation, which goes back as it ended (``protocol.FAILED``)."""
    content = RecordDict()
    content[ARRAYS_RECORD] = ArrayRecord()
    content[METRICS_RECORD] = MetricRecord()
    _add_evaluation(content, evaluation, {"train": _reason(error)})
    return Message(content, reply_to=msg)


def _add_evaluation(content: RecordDict, evaluation: EvaluateReply | Exception | None, failed: dict) -> None:
    if isinstance(evaluation, Exception):
        failed["evaluation"] = _reason(evaluation)
    elif evaluation is not None:
        tensors, figures = evaluation.to_records()
        check_outgoing(tensors, allowed=())
        content[EVALUATION] = _metric_record(figures, EVALUATE)
    if failed:
        content[FAILED] = ConfigRecord(failed)


def _reason(error: Exception) -> str:
    return public_text(error)


class NodeError(PublicError, RuntimeError):
    """Raised in place of an error whose text stays on the node (``public_errors``)."""


def public_text(error: BaseException) -> str:
    """What may leave the node of ``error`` (``fedvlm.errors``): its text where its class promises
    that the text carries no value of the node's records, else its class name alone (its text is
    logged here, on the node)."""
    if isinstance(error, PublicError):
        return f"{type(error).__name__}: {error}"
    log.error("an error whose text stays on this node: %s: %s", type(error).__name__, error, exc_info=error)
    return (
        f"{type(error).__name__} (its text is in this node's log, not in the reply: an error's text may carry "
        "values of the node's records)"
    )


def public_errors(inner: Callable[[Message, Context], Message]) -> Callable[[Message, Context], Message]:
    """``inner`` (a node's handlers), whose errors leave with ``public_text`` only."""

    def handle(msg: Message, context: Context) -> Message:
        try:
            return inner(msg, context)
        except PublicError:
            raise
        except Exception as err:  # noqa: BLE001 - every other error: its text stays on the node
            raise NodeError(f"the node's {msg.metadata.message_type} message failed: {public_text(err)}") from None

    return handle


def hello_reply(msg: Message, report: HelloReport) -> Message:
    """The handshake's reply: the node's words and sizes, and no tensor (an empty ``arrays``
    record, so that every reply has the same two records, and the handshake a third)."""
    info, metrics = report.to_records()
    content = RecordDict()
    content[ARRAYS_RECORD] = ArrayRecord()
    content[INFO_RECORD] = ConfigRecord(info)
    content[METRICS_RECORD] = _metric_record(metrics)
    return Message(content, reply_to=msg)


def _metric_record(metrics: Mapping[str, float | int], message: str | None = None) -> MetricRecord:
    """The reply's figures; for a train or evaluate reply (``message``) only those the catalogue
    declares for it (``fedvlm.metrics``): the ledger lists them as released, and a made-up name
    could itself carry a value of the node's data, so the refusal does not name it."""
    for name in metrics if message in (TRAIN, EVALUATE) else ():
        why = reply_metric(str(name), str(message))
        if isinstance(why, str):
            log.error("refused to send metric %r: %s", name, why)
            raise PrivacyGuardError(
                f"refusing to send a metric the project does not declare for {message} replies (its name is in "
                "this node's log): nothing undeclared leaves the node"
            )
    return MetricRecord({k: (float(v) if isinstance(v, (float, np.floating)) else int(v)) for k, v in metrics.items()})
