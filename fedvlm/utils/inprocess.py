"""A federation in one process, without Ray or a SuperLink: the real ServerApp strategy and
the real ClientApp, with messages passed as Python objects.

Tests use it to drive whole rounds in a second, and benchmarks use it to separate client
compute from Flower/Ray overhead. Everything that crosses the "network" here is a real
Flower ``Message``; a ClientApp exception becomes an error reply, as in Flower.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from fedvlm.utils.runtime import in_process_node

IDENTITY = ("_run_id", "_node_id", "_task_id")  # what Flower's runtime sets on TaskIdentity


def check_flower() -> str | None:
    """Why Flower's task identity is not the one set here (None: it is)."""
    from flwr.supercore.task_identity import TaskIdentity

    missing = [a for a in IDENTITY if not hasattr(TaskIdentity, a)]
    return f"TaskIdentity has no {', '.join(missing)}" if missing else None


def ensure_task_identity(run_id: int = 1) -> None:
    """Flower stamps new messages with the identity of the running task, which its runtime
    sets; outside a Flower process we set a server identity ourselves."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in zip(IDENTITY, (run_id, 0, 0), strict=True):
        if getattr(TaskIdentity, attr) is None:
            setattr(TaskIdentity, attr, value)


class InProcessGrid:
    """Duck-types the parts of ``flwr.serverapp.Grid`` the strategies use."""

    def __init__(
        self,
        client_app: ClientApp,
        node_configs: list[dict],
        run_config: dict,
        intercept: Callable[[Message, Message], Message | None] | None = None,
        forge: Callable[[Message], Message | list[Message] | None] | None = None,
        simulation: bool = False,
    ):
        ensure_task_identity()
        self.app = client_app
        self.run_config = dict(run_config)
        self.contexts = {
            1000 + i: Context(
                run_id=1, node_id=1000 + i, node_config=dict(nc), state=RecordDict(), run_config=self.run_config
            )
            for i, nc in enumerate(node_configs)
        }
        self.sent: list[Message] = []
        self.replies: list[Message] = []
        self.intercept = intercept  # (request, reply) -> reply, or None to lose it; lets tests corrupt replies
        # request -> replies made up in place of the node's (None: the node answers); several
        # replies, or one in another node's name, are what a SuperLink would never deliver
        self.forge = forge
        self.offline: set[int] = set()
        # a simulation's nodes all exist from the start (utils.runtime.simulated_grid); by
        # default the grid plays a deployment, whose nodes may connect, vanish and come back
        self.simulation = simulation
        self._pushed = 0
        self._held: dict[str, list[Message]] = {}  # message id -> its replies, until pulled

    def get_node_ids(self) -> Iterable[int]:
        return [n for n in self.contexts if n not in self.offline]

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        """Run each message's ClientApp now and keep its replies until pulled (as a SuperLink
        keeps them); the message ids, as Flower's grids give them."""
        ids = []
        for msg in messages:
            self._pushed += 1
            msg.metadata.__dict__["_message_id"] = f"in-process-{self._pushed}"
            ids.append(msg.metadata.message_id)
            self._held[msg.metadata.message_id] = self._answer(msg)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [reply for i in message_ids for reply in self._held.pop(i, [])]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))

    def _answer(self, msg: Message) -> list[Message]:
        self.sent.append(msg)
        node = msg.metadata.dst_node_id
        if node in self.offline:  # as the SuperLink answers for a node that stopped its heartbeats
            return [Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason="Error: Node Unavailable"), reply_to=msg)]
        forged = self.forge(msg) if self.forge is not None else None
        try:
            if forged is not None:
                reply = forged
            else:
                with in_process_node():  # a simulated node (utils.runtime)
                    reply = self.app(msg, self.contexts[node])
        except Exception as err:  # as Flower does: the server receives an error reply
            reply = Message(
                Error(code=1, reason=f"{type(err).__name__}: {err}\n{traceback.format_exc()}"), reply_to=msg
            )
        out = []
        for one in reply if isinstance(reply, list) else [reply]:
            delivered = self.intercept(msg, one) if self.intercept is not None else one
            if delivered is None:
                continue  # the node answered, but its reply was lost on the way
            self.replies.append(delivered)
            out.append(delivered)
        return out
