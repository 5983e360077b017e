"""The layers around a node's handlers, outermost first, wherever the handlers run (the ClientApp's
own process, ``client_app.app``; a warm worker, ``client_app.worker``): what an error may say as it
leaves (``send_guard.public_errors``), then secure aggregation (``client_app.secure_aggregation``).
Each wraps the handlers as Flower's mods wrap a ClientApp; neither is known to the handlers."""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Context, Message

from fedvlm.client_app.secure_aggregation import secure_aggregation
from fedvlm.client_app.send_guard import public_errors


def layered(handler: Callable[[Message, Context], Message]) -> Callable[[Message, Context], Message]:
    return public_errors(secure_aggregation(handler))
