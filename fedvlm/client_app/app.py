"""The ClientApp: Flower's entry point on every node, simulated or deployed.

Each message (``query``, ``train``, ``evaluate``; ``client_app.handlers`` says what each does)
runs in this process, or, when the node config names a warm worker (``node-worker``), in that
worker (``client_app.worker``): then this process imports only Flower, because Flower starts
one such process per message and the worker keeps the model and data loaded between them.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedvlm.client_app.worker import forward
from fedvlm.protocol import NODE_WORKER

app = ClientApp()


def _run(msg: Message, context: Context) -> Message:
    path = context.node_config.get(NODE_WORKER)
    if path:
        reply = forward(msg, context, str(path))
        if reply is not None:
            return reply
    from fedvlm.client_app import secure_stages  # no torch: a secure round's later stages start fast

    if secure_stages.is_later_stage(msg):
        return secure_stages.next_stage(msg, context)
    from fedvlm.client_app.handlers import handle  # torch and the models: only where the message runs

    return handle(msg, context)


@app.query()
def hello(msg: Message, context: Context) -> Message:
    return _run(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _run(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _run(msg, context)
