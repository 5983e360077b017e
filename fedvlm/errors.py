"""What may leave a node in an error's text.

An error a node raises reaches the server as its text (Flower's error reply, a failed part of a
reply). A value computed from the node's records in that text (a norm, a loss, a label, a record's
field) would be a release no mechanism noised and no ledger lists. So a node's error leaves with
its text only if its class is a ``PublicError``: a promise, kept at every place that raises it,
that the text is built from configuration, the protocol's messages and the figures the ledger
lists as released (data sizes, class counts, epsilon spent), never from a record. Any other error
leaves as its class name; its text stays in the node's own log (``client_app.send_guard.public_text``).
"""

from __future__ import annotations


class PublicError(Exception):
    """An error whose text may leave the node (the module docstring)."""
