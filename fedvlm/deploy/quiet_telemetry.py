"""Flower's telemetry event not built where it is neither sent nor logged.

Every ClientApp process of Flower 1.42 calls ``telemetry.event(FLWR_CLIENTAPP_RUN_ENTER)``, which
builds the event on a thread (``create_event``): its source id read from the Flower home, the
platform described (``platform.architecture`` runs the ``file`` command on the interpreter), then
sent only where ``FLWR_TELEMETRY_ENABLED`` is "1" and logged only where ``FLWR_TELEMETRY_LOGGING``
is "1"; otherwise it returns "disabled". A deployment sets telemetry off (docs/deployment.md), so
each ClientApp, one per node and round, built an event nobody received: 36 ms of CPU in a fresh
process, about half a forked ClientApp's own (docs/results/deployment.md, 'A ClientApp's telemetry
event, built for nobody').

Here ``create_event`` answers "disabled" at once in a process where both settings are off, which is
what Flower's answers there after the work. Where an operator turns either on, Flower's own
function stays, so what is sent or logged is unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

from fedvlm.deploy import flower_patches

DISABLED = "disabled"  # Flower's answer where it sends nothing


def create_event(event_type: Any, event_details: dict[str, Any] | None) -> str:
    """Flower's ``create_event`` where telemetry is neither sent nor logged: its answer there."""
    return DISABLED


@functools.cache  # read once by the fork server (pinned_app.prepare); every child keeps its answer
def check_flower() -> str | None:
    """Why the installed Flower's telemetry is not the one this quiets (None: it is): a
    ``create_event`` that sends only under ``FLWR_TELEMETRY_ENABLED == "1"``, logs only under
    ``FLWR_TELEMETRY_LOGGING == "1"``, and otherwise answers "disabled"."""
    import inspect

    from flwr.supercore import telemetry

    if why := flower_patches.lacking(telemetry, "create_event", "event"):
        return why
    source = " ".join(inspect.getsource(telemetry.create_event).split())
    steps = ('if FLWR_TELEMETRY_LOGGING == "1":', 'if FLWR_TELEMETRY_ENABLED == "1":', f'return "{DISABLED}"')
    if not all(step in source for step in steps) or "create_event(" not in inspect.getsource(telemetry.event):
        return "its create_event no longer sends and logs only under its two settings, answering 'disabled' otherwise"
    return None


def install() -> bool:
    """Quiet Flower's telemetry event in this process where its settings send and log nothing;
    False (Flower's own) where either is on, or, with a warning, where Flower reads otherwise."""
    from flwr.supercore import telemetry

    if telemetry.create_event is create_event:
        return True
    if "1" in (telemetry.FLWR_TELEMETRY_ENABLED, telemetry.FLWR_TELEMETRY_LOGGING):
        return False
    if not flower_patches.applies("quiet-telemetry"):
        return False
    telemetry.create_event = create_event
    return True
