"""Neighbouring datasets for one node, as its training sees them: one record in or out of every
batch it draws (``world`` 'in': its record 0 alone; 'out': nothing). The node is told apart from
the others by its number of training records, which must be its own."""

from __future__ import annotations

import numpy as np

from fedvlm.client_app import trainer


def one_record_batches(world: str, records: int, others: list[int]):
    """``trainer.batches`` with the node of ``records`` training records drawing its neighbouring
    batches; ``others``: every other node's record count (none may equal it)."""
    assert records not in others, "the node's batches are told apart by its number of records"
    honest = trainer.batches

    def batches(n, batch_size, steps, settings, rng):
        if n != records:
            yield from honest(n, batch_size, steps, settings, rng)
            return
        for _ in range(steps):
            yield np.array([0] if world == "in" else [], dtype=np.int64)

    return batches
