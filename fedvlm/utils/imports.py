"""Objects a table names by path, imported where they are used: a registry entry that names its
class or loader by ``'package.module:name'`` can be read by a config check without importing
torch or the model code behind it."""

from __future__ import annotations

import importlib
from typing import Any


def load(path: str) -> Any:
    """The object ``path`` (``'package.module:name'``) names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
