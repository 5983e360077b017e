"""What a client class tells the honest-but-curious server's attack (``attacks.server``) about
its upload: ``server_view(sent, uploaded, known)`` returns an ``UploadView``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class UploadView:
    """How the server reads one client's upload of one round (a client class's ``server_view``):
    the model it scores records with, as far as it knows it (``model``: tensors by name; what it
    does not know, e.g. a client's private local prompt, is absent or at its initial value), and
    the client's descent direction that round in each tensor the upload moves (``descent``)."""

    model: dict[str, torch.Tensor]
    descent: dict[str, torch.Tensor]


@runtime_checkable
class Observed(Protocol):
    """A client class whose uploads the server's attack reads (prompt and LoRA methods)."""

    @staticmethod
    def server_view(
        sent: dict[str, torch.Tensor], uploaded: dict[str, torch.Tensor], known: dict[str, torch.Tensor]
    ) -> UploadView: ...
