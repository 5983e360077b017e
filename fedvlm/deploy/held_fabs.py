"""A ClientApp's task input without the FAB its node has installed already.

Flower's ``PullTaskInput`` answers every ClientApp process with the run's whole FAB: 1.6 MB for
this app (the package's source; Flower stores a FAB's files uncompressed), which the process reads
only to check it against the node's pins and to find the folder Flower installed it in. With a
ClientApp forked for every message, receiving and parsing it was about a sixth of each
ClientApp's CPU (docs/results/deployment.md, 'A ClientApp's task without the FAB').

Here a ClientApp names the pinned FABs its node has installed (``held``); its SuperNode, on
``/pull-task-input-held``, answers with Flower's own ``PullTaskInputResponse`` from Flower's own
handler, and leaves the FAB's content out when the SHA-256 it computes of that content is one of
them, naming it in ``hash_str``.

Why the pin still holds: the digest is computed from the FAB's bytes by the node's own SuperNode,
never taken from the run, and that SuperNode checked the same bytes against the same pins when it
received them (``deploy.supernode_gate``). The ClientApp still refuses a digest that is not one of
its pins (``pinned_app.check_digest``) and then runs the folder installed for that digest
(``installed``), which exists only because an earlier ClientApp of this node checked those bytes
before Flower unpacked them: the same folder ``pinned_app.installed_app`` trusts when the bytes do
come. A folder removed in between fails the one task with an error naming it; the next task, no
longer naming that FAB as held, gets its bytes.
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

ROUTE = "/pull-task-input-held"  # on the SuperNode's Runtime API, beside Flower's /pull-task-input


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


def pull_task_input_held(request, state, handlers, task):
    """The SuperNode's answer: Flower's, without the content of a FAB the ClientApp holds."""
    answer = handlers.pull_task_input(request.task, state, task)
    digest = hashlib.sha256(answer.fab.content).hexdigest()
    if digest in {fab.hash_str for fab in request.held}:
        answer.fab.ClearField("content")
        answer.fab.hash_str = digest
    return answer


def serve() -> bool:
    """Serve ``ROUTE`` on this SuperNode's Runtime API, before it builds its app; False, with a
    warning, where Flower's Runtime router is not the one this extends."""
    from flwr.proto.runtime_pb2 import PullTaskInputResponse

    if not flower_patches.applies("held-fabs"):
        return False
    _, _, runtime, translation = object_batches.server_parts()
    kind = object_batches.kinds()["PullTaskInputHeldRequest"]
    endpoints = {ROUTE: (pull_task_input_held, kind, PullTaskInputResponse)}
    table = translation.PROTOBUF_REQUEST_TYPES
    object_batches.route(runtime.router, object_batches.RUNTIME, endpoints, object_batches.runtime_depends(), table)
    return True


class Puller:
    """``client.PullTaskInput`` for a ClientApp of a node with ``pins``: the FABs in ``held(pins)``
    without their content (``withheld``: the digest of the one the SuperNode left out, if it did);
    Flower's own call where the SuperNode does not serve ``ROUTE`` or Flower does not read as this
    expects."""

    def __init__(self, client, pins: Iterable[str]):
        self.client, self.flower, self.withheld = client, client.PullTaskInput, None
        self.held = held(pins) if flower_patches.applies("held-fabs") else []

    def __call__(self, request):
        from flwr.proto.fab_pb2 import Fab
        from flwr.proto.runtime_pb2 import PullTaskInputResponse

        if not self.held:
            return self.flower(request)
        kind = object_batches.kinds()["PullTaskInputHeldRequest"]
        sent = kind(task=request, held=[Fab(hash_str=h) for h in self.held])
        path = object_batches.RUNTIME + ROUTE
        try:
            answer = self.client._unary_unary(
                path=path, rpc_method=f"/fedvlm{path}", request=sent, response_type=PullTaskInputResponse
            )
        except httpx.HTTPStatusError as err:
            if err.response.status_code not in object_batches.ABSENT:
                raise
            return self.flower(request)
        if not answer.fab.content and answer.fab.hash_str in self.held:
            self.withheld = answer.fab.hash_str
        return answer


@functools.cache  # Flower's code in this process does not change; the fork server's answer is its children's
def check_flower() -> str | None:
    """Why the installed Flower's ClientApp runtime or SuperNode Runtime API is not the one this
    changes (None: it is): the runtime must pull its task input with ``client.PullTaskInput`` and
    the SuperNode answer it with its handlers' ``pull_task_input``."""
    import flwr.supernode.runtime.run_clientapp as runtime
    from flwr.supernode.servicer.runtime import runtime_handlers

    if why := object_batches.check_server() or flower_patches.lacking(runtime_handlers, "pull_task_input"):
        return why
    if "client.PullTaskInput(PullTaskInputRequest())" not in inspect.getsource(runtime.pull_task_input):
        return "its ClientApp runtime no longer pulls its task input with client.PullTaskInput"
    return None
