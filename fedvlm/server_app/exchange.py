"""One exchange on the grid (a round's train messages, and the previous round's evaluation,
``server_app.post``): push the messages, pull the replies as they come, and decide when
a reply is late.

Flower's ``Grid.send_and_receive`` waits for every reply or for ``round-timeout`` (600 s by
default), polling every 3 s. A reply lost on the way (a SuperLink that answered the SuperNode's
push with an error, a node that crashed) then costs the whole round-timeout. Here:

- replies are pulled as they come: at once after a pull that brought some, otherwise at most every
  ``POLL_S`` seconds (a SuperLink that holds the look, ``deploy.long_pulls``, answers an empty one
  only after its hold);
- once no other reply of the exchange is still coming in, the ones missing get a grace period:
  ``reply-grace`` seconds, or ``GRACE_FACTOR`` times the slowest reply time seen (this round's,
  and the node's own in earlier rounds) if that is longer, so a node with more data or a slower
  machine is not taken for lost; a node that has never answered yet (its first round) is waited
  for until round-timeout, as there is nothing to judge it by;
- a late message is asked again once (``server_app.post`` makes the copies and decides
  what the copy costs in privacy); whichever of the two
  replies comes first is the node's, the other is never pulled;
- after one more grace period the round goes on without it, never later than round-timeout.

With ``reply-grace = 0`` an exchange waits for every reply until round-timeout, as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from flwr.app import Message

log = logging.getLogger(__name__)

POLL_S = 0.2
GRACE_FACTOR = 2.0


class Exchanger:
    """Sends each exchange's messages for a whole run; remembers each node's reply times."""

    def __init__(self, grid, round_timeout: float, grace: float):
        self.grid = grid
        self.round_timeout = round_timeout
        self.grace = grace
        self.seen: dict[int, float] = {}  # node id -> its slowest reply, seconds

    def _grace_for(self, nodes: Iterable[int], slowest_now: float) -> float | None:
        """Seconds the missing replies of ``nodes`` may still take once no other is arriving;
        None while one of them has never answered yet (its first round, a node that joined
        late): it may be slow by nature (more data, a slower machine, loading its model), so it
        gets round-timeout, as without a grace. A node's slowest reply of any kind judges it: a
        train message (which may carry an evaluation) takes longer than an evaluation alone."""
        nodes = list(nodes)
        own = [self.seen[n] for n in nodes if n in self.seen]
        if len(own) < len(nodes):
            return None
        return max(self.grace, GRACE_FACTOR * max([slowest_now, *own]))

    def run(self, messages: list[Message], ask_again: Callable[[list[Message]], list[Message]]) -> list[Message]:
        """Every reply pulled for ``messages`` (of a node asked again, only what came for the
        first of its two messages to be answered); the strategy judges each reply's origin and
        sees who did not answer by who it asked (``FederatedStrategy.validate``)."""
        if not messages:
            return []
        if self.grace <= 0:
            return list(self.grid.send_and_receive(messages, timeout=self.round_timeout))
        start = time.time()
        deadline = start + self.round_timeout
        pending: dict[str, Message] = {}  # message id -> message
        sent_at: dict[str, float] = {}
        for msg, mid in zip(messages, self.grid.push_messages(messages), strict=True):
            pending[mid], sent_at[mid] = msg, start
        replies: list[Message] = []
        tried: set[int] = set()  # nodes whose late message was considered for asking again
        slowest, last_arrival = 0.0, start
        while pending and time.time() < deadline:
            now = time.time()
            pulled = list(self.grid.pull_messages(list(pending)))
            for reply in pulled:
                replies.append(reply)  # every one: the strategy judges where it comes from
                answers = reply.metadata.reply_to_message_id
                if answers not in pending:
                    continue
                node = pending[answers].metadata.dst_node_id
                took = now - sent_at[answers]
                slowest, last_arrival = max(slowest, took), now
                self.seen[node] = max(self.seen.get(node, 0.0), took)
                for other in [m for m, sent in pending.items() if sent.metadata.dst_node_id == node]:
                    del pending[other]  # the node's other copy, if it was asked again: never pulled
            if not pending:
                break
            waiting = {m.metadata.dst_node_id for m in pending.values()}
            grace = self._grace_for(waiting, slowest)
            if grace is not None and now - last_arrival >= grace:
                late = [m for m in pending.values() if m.metadata.dst_node_id not in tried]
                if not late:
                    break  # asked again once already: the round goes on without them
                copies = ask_again(late)
                tried.update(m.metadata.dst_node_id for m in late)
                for msg, mid in zip(copies, self.grid.push_messages(copies), strict=True):
                    pending[mid], sent_at[mid] = msg, time.time()
                log.warning(
                    "%d repl%s (%s) late after a %.1f s grace: asked again once",
                    len(late),
                    "y" if len(late) == 1 else "ies",
                    ", ".join(sorted({m.metadata.message_type for m in late})),
                    grace,
                )
                last_arrival = time.time()
                continue
            if not pulled:  # a SuperLink that holds the look (deploy.long_pulls) answered after its hold
                time.sleep(max(0.0, POLL_S - (time.time() - now)))
        return replies
