"""A ClientApp's task in one call to its SuperNode, without the FAB its node has installed.

Flower's ClientApp process starts with three kinds of Runtime API call to its SuperNode:
``PullTaskInput`` (the run, the context and the run's whole FAB), ``PullMessages`` (the message
and its object tree) and the message's objects (one ``pull-objects`` batch,
``deploy.object_batches``). The FAB is 1.6 MB for this app (the package's source; Flower stores a
FAB's files uncompressed), which the process reads only to check it against the node's pins and
to find the folder Flower installed it in (docs/results/deployment.md, 'A ClientApp's task in one
call, without the FAB').

Here a ClientApp asks ``/pull-task`` once, naming the pinned FABs its node has installed
(``held``). The SuperNode answers ``TaskInput {task, messages, objects}``: Flower's
``pull_task_input`` answer, its FAB's content left out when the SHA-256 the SuperNode computes of
that content is one of ``held`` (then named in ``hash_str``); Flower's ``pull_messages`` answer;
and Flower's ``pull_object`` answers for the message's objects in the tree's order, up to
``BATCH_BYTES`` of content. Each part comes from Flower's own handler for the task the caller's
token names, in the order the process would have asked. The process hands the parts to Flower's
own code through the calls it would have made (``Puller``): ``PullMessages`` answers with the
message once, and the object batch finds the contents ready (``object_batches.Link.ready``); what
did not fit is pulled as before. A SuperNode without the route (403, 404) gets Flower's calls.

Why the pin still holds: a left-out FAB's digest is computed from its bytes by the node's own
SuperNode, never taken from the run, and that SuperNode checked the same bytes against the same
pins when it received them (``deploy.supernode_gate``). The ClientApp still refuses a digest that
is not one of its pins (``pinned_app.check_task_fab``) and then runs the folder installed for that
digest (``installed``), which exists only because an earlier ClientApp of this node checked those
bytes before Flower unpacked them: the folder ``pinned_app.installed_app`` trusts when the bytes
do come. A folder removed in between fails the one task with an error naming it; the next task, no
longer naming that FAB as held, gets its bytes. The message's signature is checked as before, on
the message Flower inflated from these contents.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
from collections.abc import Iterable
from pathlib import Path

import httpx

from fedvlm.deploy import flower_patches, object_batches

ROUTE = "/pull-task"  # on the SuperNode's Runtime API, beside Flower's /pull-task-input


class FabWithheld(RuntimeError):
    """The SuperNode left a FAB out as installed, and no folder is installed for it here."""


def held(pins: Iterable[str]) -> list[str]:
    """The pins whose FAB Flower has installed on this node (a folder named by the FAB's hash)."""
    from flwr.common.config import get_flwr_home
    from flwr.common.constant import APP_DIR, FAB_HASH_TRUNCATION

    try:
        names = os.listdir(get_flwr_home() / APP_DIR)
    except OSError:  # nothing installed yet
        return []
    suffixes = {name.rsplit(".", 1)[-1] for name in names}
    return sorted(p for p in pins if p[:FAB_HASH_TRUNCATION] in suffixes)


def installed(fab_id: str, fab_version: str, digest: str) -> Path:
    """The folder Flower installed the FAB of ``digest`` in (``FabWithheld``: none)."""
    from flwr.common.config import get_project_dir

    path = get_project_dir(fab_id, fab_version, digest)
    if not path.is_dir():
        raise FabWithheld(
            f"the SuperNode left out the FAB {fab_id} {fab_version} (sha256 {digest}) as installed on this node, "
            f"but {path} is not there (removed?): this task fails; the node's next ClientApp is sent the FAB again"
        )
    return path


def pull_task(request, state, handlers, task):
    """The SuperNode's answer: Flower's task input (without the content of a FAB the ClientApp
    holds), Flower's next message for the task, and that message's objects."""
    from flwr.proto.message_pb2 import PullObjectRequest
    from flwr.proto.node_pb2 import Node
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest
    from flwr.supercore.inflatable.inflatable_utils import iterate_object_tree

    answer = handlers.pull_task_input(request.task, state, task)
    digest = hashlib.sha256(answer.fab.content).hexdigest()
    if digest in {fab.hash_str for fab in request.held}:
        answer.fab.ClearField("content")
        answer.fab.hash_str = digest
    messages = handlers.pull_messages(PullAppMessagesRequest(), state, task)
    objects, size, node = [], 0, Node(node_id=answer.context.node_id)
    for tree in list(messages.message_object_trees)[:1]:
        for part in iterate_object_tree(tree):
            ask = PullObjectRequest(node=node, run_id=task.run_id, object_id=part.object_id)
            got = handlers.pull_object(ask, state, task)
            size += len(got.object_content)
            if not got.object_available or size > object_batches.BATCH_BYTES:
                break
            objects.append(got)
    return object_batches.kinds()["TaskInput"](task=answer, messages=messages, objects=objects)


def serve() -> bool:
    """Serve ``ROUTE`` on this SuperNode's Runtime API, before it builds its app; False, with a
    warning, where Flower's Runtime router is not the one this extends."""
    if not flower_patches.applies("task-input"):
        return False
    _, _, runtime, translation = object_batches.server_parts()
    kinds = object_batches.kinds()
    endpoints = {ROUTE: (pull_task, kinds["TaskInputRequest"], kinds["TaskInput"])}
    table = translation.PROTOBUF_REQUEST_TYPES
    object_batches.route(runtime.router, object_batches.RUNTIME, endpoints, object_batches.runtime_depends(), table)
    return True


class Puller:
    """``client.PullTaskInput`` for a ClientApp of a node with ``pins``: the whole task in one call,
    the FABs in ``held(pins)`` without their content (``withheld``: the digest of the one the
    SuperNode left out, if it did). Flower's own call where the SuperNode does not serve ``ROUTE``
    or Flower does not read as this expects."""

    def __init__(self, client, pins: Iterable[str]):
        self.client, self.flower, self.withheld = client, client.PullTaskInput, None
        self.served = flower_patches.applies("task-input")
        self.held = held(pins) if self.served else []

    def __call__(self, request):
        from flwr.proto.fab_pb2 import Fab

        if not self.served:
            return self.flower(request)
        kinds, path = object_batches.kinds(), object_batches.RUNTIME + ROUTE
        sent = kinds["TaskInputRequest"](task=request, held=[Fab(hash_str=h) for h in self.held])
        try:
            whole = self.client._unary_unary(
                path=path, rpc_method=f"/fedvlm{path}", request=sent, response_type=kinds["TaskInput"]
            )
        except httpx.HTTPStatusError as err:
            if err.response.status_code not in object_batches.ABSENT:
                raise
            return self.flower(request)
        self._hand_on(whole)
        if not whole.task.fab.content and whole.task.fab.hash_str in self.held:
            self.withheld = whole.task.fab.hash_str
        return whole.task

    def _hand_on(self, whole) -> None:
        """The message for Flower's next ``PullMessages``, once, and its objects for the batch
        that pulls them (what it does not find it asks the SuperNode for)."""
        from flwr.supercore.inflatable.inflatable_utils import iterate_object_tree

        client, flower = self.client, self.client.PullMessages

        def pull_messages(request):
            client.PullMessages = flower
            return whole.messages

        client.PullMessages = pull_messages
        if whole.objects and whole.messages.message_object_trees:
            link = object_batches.Link(client, whole.task.context.node_id, object_batches.RUNTIME)
            ids = [t.object_id for t in iterate_object_tree(whole.messages.message_object_trees[0])]
            link.ready = {i: got.object_content for i, got in zip(ids, whole.objects, strict=False)}
            object_batches.LINKS[client] = link


@functools.cache  # Flower's code in this process does not change; the fork server's answer is its children's
def check_flower() -> str | None:
    """Why the installed Flower's ClientApp runtime or SuperNode Runtime API is not the one this
    changes (None: it is): the runtime must pull its task input, then its message, then the
    message's objects through ``client`` and the object batches, and the SuperNode answer each
    with its handlers."""
    import flwr.supernode.runtime.run_clientapp as runtime
    from flwr.supernode.servicer.runtime import runtime_handlers

    names = ("pull_task_input", "pull_messages", "pull_object")
    if why := object_batches.check_server() or flower_patches.lacking(runtime_handlers, *names):
        return why
    source = inspect.getsource(runtime.pull_task_input)
    said = ("client.PullTaskInput(PullTaskInputRequest())", "client.PullMessages(", "make_pull_object_fn_protobuf(")
    if not all(s in source for s in said) or source.index(said[0]) > source.index(said[1]):
        return "its ClientApp runtime no longer pulls its task input, then its message, through its client"
    return object_batches.check_runtime_clients()
