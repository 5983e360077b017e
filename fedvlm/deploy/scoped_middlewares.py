"""The SuperLink's HTTP middlewares, each entered only by the requests it acts on.

Flower 1.42's SuperLink app runs every request through eight ``BaseHTTPMiddleware`` layers
(``flwr.superlink.main._get_middleware``). Each layer costs a task group, a request object and a
wrapped response stream whether it acts or not: measured here about 0.27 ms of CPU a layer and
request (``bench/middleware_layers.py``), several times the cost of the route itself. Six of the
eight act on one API only and hand every other request straight to ``call_next``:

| Flower's middleware | acts on |
|---|---|
| ControlSensitiveResponseMiddleware | Control API auth routes (all under ``/v1/control/``) |
| ControlAuthenticationMiddleware, ControlLicenseMiddleware | ``/v1/control/`` (the licence: with a plugin) |
| ControlEventLogMiddleware | ``/v1/control/`` with a Control event-log plugin |
| NodeAuthMiddleware | ``/v1/fleet/`` |
| FleetEventLogMiddleware | ``/v1/fleet/`` with a Fleet event-log plugin |

``Scoped`` is a pure-ASGI gate around one of them: a request it does not act on goes to the next
layer without entering it. Nothing a layer decides changes: where it acts, it runs as Flower wrote
it; where it would have called ``call_next`` at once, the next layer gets the same scope, receive
and send. The error translator and the protobuf translation act on every request and stay as they
are. A Fleet call (a node's pull, push, heartbeat) passes three layers instead of eight (four with a
Fleet event-log plugin); a ServerApp's or SuperExec's runtime call two.

The guard (``check_flower``) reads each of the six dispatch methods and finds the early hand-on
this relies on, and finds every Control auth route under ``/v1/control/``. A Flower that reads
otherwise gets its middlewares unchanged, with a warning (nothing but speed is lost).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fedvlm.deploy.flower_patches import applies, lacking

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

CONTROL, FLEET = "/v1/control/", "/v1/fleet/"


def _path(scope: Scope) -> str:
    from starlette.datastructures import URL

    return URL(scope=scope).path  # what the layers test (request.url.path), not a second reading of it


def _plugin(scope: Scope, name: str) -> bool:
    return getattr(scope["app"].state, name, None) is not None


# Flower's middleware -> (whether a request enters it, what its dispatch must say for that to be its
# own rule: the lines that hand everything else straight to call_next)
ACTS_ON: dict[str, tuple[Callable[[Scope, Any], bool], tuple[str, ...]]] = {
    "ControlSensitiveResponseMiddleware": (
        lambda scope, layer: _path(scope).startswith(CONTROL),
        (
            'response = await call_next(request) if _is_control_sensitive_route(request): response.headers["Cache-'
            'Control"] = "no-store" response.headers["Pragma"] = "no-cache" return response',
        ),
    ),
    "ControlAuthenticationMiddleware": (
        lambda scope, layer: _path(scope).startswith(CONTROL),
        (
            "if not _is_control_path(request.url.path) or _is_control_auth_route(request): "
            "return await call_next(request)",
        ),
    ),
    "ControlLicenseMiddleware": (
        lambda scope, layer: layer._license_plugin is not None and _path(scope).startswith(CONTROL),
        ("if self._license_plugin is None or not _is_control_path(request.url.path): return await call_next(request)",),
    ),
    "ControlEventLogMiddleware": (
        lambda scope, layer: _path(scope).startswith(CONTROL) and _plugin(scope, "control_event_log_plugin"),
        (
            "if not _is_control_path(request.url.path) or _is_control_sensitive_route( request ): "
            "return await call_next(request)",
            'event_log_plugin: EventLogWriterPlugin | None = getattr( request.app.state, "control_event_log_plugin", '
            'None ) protobuf_request = getattr(request.state, "protobuf_request", None) if event_log_plugin is None '
            "or not isinstance(protobuf_request, Message): return await call_next(request)",
        ),
    ),
    "NodeAuthMiddleware": (
        lambda scope, layer: _path(scope).startswith(FLEET),
        ('if request.url.path.startswith("/v1/fleet/") and isinstance(',),
    ),
    "FleetEventLogMiddleware": (
        lambda scope, layer: _path(scope).startswith(FLEET) and _plugin(scope, "fleet_event_log_plugin"),
        (
            'if not request.url.path.startswith("/v1/fleet/"): return await call_next(request)',
            'plugin: EventLogWriterPlugin | None = getattr( request.app.state, "fleet_event_log_plugin", None ) '
            'protobuf_request = getattr(request.state, "protobuf_request", None) if plugin is None or not '
            "isinstance(protobuf_request, Message): return await call_next(request)",
        ),
    ),
}


class Scoped:
    """One of Flower's middlewares, entered only by the HTTP requests it acts on (``ACTS_ON``)."""

    def __init__(self, app: ASGIApp, /, *, layer: type, acts_on: Callable[[Scope, Any], bool], **kwargs: Any) -> None:
        self.app, self.layer, self.acts_on = app, layer(app, **kwargs), acts_on

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.acts_on(scope, self.layer):
            await self.app(scope, receive, send)
        else:
            await self.layer(scope, receive, send)


def scoped(middlewares: list) -> list:
    """Flower's middleware list with each layer of ``ACTS_ON`` behind its gate, in the same order."""
    from starlette.middleware import Middleware

    return [
        Middleware(Scoped, *m.args, layer=m.cls, acts_on=ACTS_ON[m.cls.__name__][0], **m.kwargs)
        if getattr(m.cls, "__name__", "") in ACTS_ON
        else m
        for m in middlewares
    ]


def _words(source: str) -> str:
    return " ".join(re.sub(r"#.*", "", source).split())


def check_flower(module: Any) -> str | None:
    """Why the installed SuperLink's middlewares are not the ones this gates (None: they are)."""
    why = lacking(module, "_get_middleware")
    if why:
        return why
    layers = {m.cls.__name__: m.cls for m in module._get_middleware() if hasattr(m.cls, "__name__")}
    missing = sorted(set(ACTS_ON) - set(layers))
    if missing:
        return f"its middlewares no longer include {', '.join(missing)}"
    for name, (_, says) in ACTS_ON.items():
        source = _words(inspect.getsource(layers[name].dispatch))
        if not all(s in source for s in says):
            return f"{name}.dispatch no longer hands other requests straight on as this expects"
    from flwr.superlink.routers.control import middlewares

    if not all(path.startswith(CONTROL) for _, path in middlewares.CONTROL_SENSITIVE_ROUTE_KEYS):
        return "a Control auth route lies outside /v1/control/"
    if not _words(inspect.getsource(middlewares._is_control_path)).endswith('return path.startswith("/v1/control/")'):
        return "_is_control_path no longer reads /v1/control/"
    return None


def install() -> bool:
    """Gate the SuperLink app's middlewares (before ``create_app`` builds it). Returns whether it did."""
    from flwr.superlink import main

    if getattr(main._get_middleware, "scoped", False):
        return True
    if not applies("scoped-middlewares"):
        return False
    flower_list = main._get_middleware

    def gated() -> list:
        return scoped(flower_list())

    gated.scoped = True  # type: ignore[attr-defined]
    main._get_middleware = gated
    return True
