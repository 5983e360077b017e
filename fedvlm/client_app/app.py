"""The ClientApp: Flower's entry point on every node, simulated or deployed.

Each message (``query``, ``train``, ``evaluate``; ``client_app.handlers`` says what each does)
runs in this process, or, when the node config names a warm worker (``node-worker``), in that
worker (``client_app.worker``): then this process imports only Flower, because Flower starts
one such process per message and the worker keeps the model and data loaded between them.
The node's layers (``client_app.layers``: what an error may say, secure aggregation) wrap the
handlers wherever they run; secure aggregation's later stages need neither torch nor the model.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedvlm.client_app.layers import layered
from fedvlm.client_app.worker import forward
from fedvlm.protocol import NODE_WORKER

app = ClientApp()


def _here(msg: Message, context: Context) -> Message:
    from fedvlm.client_app.handlers import handle  # torch and the models: only where the message needs them

    return handle(msg, context)


_layered_here = layered(_here)


def _run(msg: Message, context: Context) -> Message:
    path = context.node_config.get(NODE_WORKER)
    if path:
        reply = forward(msg, context, str(path))
        if reply is not None:
            return reply
    return _layered_here(msg, context)


@app.query()
def hello(msg: Message, context: Context) -> Message:
    return _run(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _run(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _run(msg, context)
