"""A node's private state on its own disk (client_app.state): where it goes, when it is written,
which snapshot a message of a given round restores, and that only the node can read it."""

from __future__ import annotations

import stat

import torch
from flwr.app import RecordDict

from fedvlm.client_app.state import (
    HELD,
    LEDGER,
    META,
    PRIVATE,
    load_meta,
    load_private,
    persist,
    restore,
    run_folder,
    save_meta,
    save_private,
    state_dir,
)
from fedvlm.utils.runtime import in_process_node


def _train_round(state: RecordDict, where, r: int) -> None:
    """What a node's round does to its state: restore, change, persist."""
    restore(state, where, r, training=True)
    save_private(state, {"local": torch.full((2, 3), float(r))})
    save_meta(state, {"rounds-trained": r})
    persist(state, where, r)


def test_where_a_node_keeps_its_state(tmp_path):
    run = str(tmp_path / "runs" / "promptfl-x")
    own = {"state-dir": str(tmp_path / "org")}
    folder = run_folder(run)
    assert folder.startswith("promptfl-x-") and len(folder) == len("promptfl-x-") + 12
    assert state_dir(own, run, -1, "hospital-a") == tmp_path / "org" / folder / "hospital-a"
    assert state_dir(own, run, 3, "client-3") == tmp_path / "org" / folder / "client-3"  # the node's choice wins
    # whatever the server names, the run's folder is one component inside the node's state-dir
    for hostile in ("..", "/", "/srv/../..", "a/../../etc", "", ".", "x" * 5000, "../../" + run):
        inside = state_dir(own, hostile or "/", -1, "hospital-a")
        assert inside is not None and inside.parent.parent == tmp_path / "org" and ".." not in inside.parts
        assert len(inside.parent.name) <= 64 + 13
    assert run_folder(run) != run_folder(run + "/") != run_folder("/other/runs/promptfl-x")
    assert state_dir({}, run, -1, "hospital-a") is None  # deployed without state-dir: memory only
    # a partition node writes under the server's run folder only when simulated: a real node
    # (a SuperNode given partition-id) never puts private state where the server's path says
    assert state_dir({}, run, 3, "client-3") is None
    with in_process_node():
        assert state_dir({}, run, 3, "client-3") == tmp_path / "runs" / "promptfl-x" / "nodes" / "client-3"
    assert state_dir(own, "", 3, "client-3") is None  # no run named (the handshake)


def test_snapshots_are_owner_only_and_the_two_newest_are_kept(tmp_path):
    where = tmp_path / "org" / "run" / "node"
    state = RecordDict()
    for r in (1, 2, 4, 7):
        _train_round(state, where, r)
    assert sorted(p.name for p in where.iterdir()) == ["round-0004.pt", "round-0007.pt"]
    assert stat.S_IMODE(where.stat().st_mode) == 0o700
    # a file the operator put beside them is not a round's snapshot: neither read nor pruned
    (where / "round-0003-bak.pt").write_bytes(b"the operator's")
    _train_round(state, where, 8)
    assert sorted(p.name for p in where.iterdir()) == ["round-0003-bak.pt", "round-0007.pt", "round-0008.pt"]
    (where / "round-0003-bak.pt").unlink()
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in where.iterdir())


def test_an_unchanged_state_is_not_written_again(tmp_path):
    where = tmp_path / "node"
    state = RecordDict()
    _train_round(state, where, 1)
    # an evaluation that re-saves the same tensors and bookkeeping changes nothing on disk
    save_private(state, load_private(state))
    save_meta(state, load_meta(state))
    assert persist(state, where, 1) is None and persist(state, where, 2) is None
    assert [p.name for p in where.iterdir()] == ["round-0001.pt"]


def test_a_restarted_node_restores_what_the_servers_last_round_can_build_on(tmp_path):
    where = tmp_path / "node"
    state = RecordDict()
    for r in (1, 2, 3):
        _train_round(state, where, r)
    # the server completed round 2 and was killed in round 3: it resumes with round 3
    fresh = RecordDict()
    assert restore(fresh, where, 3, training=True) == 2
    assert torch.equal(load_private(fresh)["local"], torch.full((2, 3), 2.0))
    assert load_meta(fresh) == {"rounds-trained": 2}
    # an evaluation of round 3 may use the node's round-3 state
    assert restore(RecordDict(), where, 3, training=False) == 3


def test_a_state_in_memory_ahead_of_the_round_is_replaced(tmp_path):
    where = tmp_path / "node"
    state = RecordDict()
    for r in (1, 2, 3):
        _train_round(state, where, r)
    assert int(state[HELD]["round"]) == 3
    assert restore(state, where, 4, training=True) is None  # current: memory kept
    assert restore(state, where, 3, training=True) == 2  # the server went back to round 2
    assert torch.equal(load_private(state)["local"], torch.full((2, 3), 2.0))


def test_a_node_with_no_snapshot_before_the_round_starts_afresh(tmp_path):
    where = tmp_path / "node"
    state = RecordDict()
    _train_round(state, where, 5)
    assert restore(state, where, 3, training=True) is None
    assert PRIVATE not in state and META not in state  # not the state of a round the resumed run has not reached


def test_the_privacy_ledger_is_never_rolled_back(tmp_path):
    where = tmp_path / "node"
    state = RecordDict()
    for r in (1, 2, 3):
        restore(state, where, r, training=True)
        save_meta(state, {"round": list(range(1, r + 1))}, LEDGER)
        save_private(state, {"local": torch.full((1,), float(r))})
        persist(state, where, r)
    fresh = RecordDict()
    assert restore(fresh, where, 3, training=True) == 2  # the private state of round 2
    assert load_meta(fresh, LEDGER) == {"round": [1, 2, 3]}  # but round 3 did leave the node
    assert persist(fresh, where, 3) is not None


def test_a_damaged_snapshot_is_refused_naming_the_file_not_replaced_by_an_older_one(tmp_path):
    """An older snapshot's ledger would forget what the node released since: no fallback."""
    import pytest

    from fedvlm.utils.files import UnreadableFile

    where = tmp_path / "org" / "run" / "node"
    state = RecordDict()
    for r in (1, 2):
        _train_round(state, where, r)
    newest = where / "round-0002.pt"
    newest.write_bytes(newest.read_bytes()[:64])
    with pytest.raises(UnreadableFile, match=r"round-0002\.pt cannot be read.*cannot be restored"):
        restore(RecordDict(), where, 3, training=True)
    # a file torch reads but that is no snapshot (a bare TypeError/KeyError named neither)
    import torch

    for other in ([1, 2], {"round": 2}, {"round": 2, "records": {"x": ("weights", {})}}):
        torch.save(other, newest)
        with pytest.raises(UnreadableFile, match=r"round-0002\.pt is not a snapshot of a node's state"):
            restore(RecordDict(), where, 3, training=True)


def test_flipped_bytes_in_a_snapshot_are_refused_not_restored_as_other_numbers(tmp_path):
    """A torch file's zip does not check its tensors' bytes on load: the digest saved with each
    snapshot does, so damage inside a tensor is refused, naming the file."""
    import pytest

    from fedvlm.utils.files import UnreadableFile

    where = tmp_path / "node"
    state = RecordDict()
    for r in (1, 2):
        _train_round(state, where, r)
    newest = where / "round-0002.pt"
    data = bytearray(newest.read_bytes())
    at = data.index(torch.full((2, 3), 2.0).numpy().tobytes())  # the private tensor's own bytes
    data[at : at + 4] = torch.tensor([7.0]).numpy().tobytes()
    newest.write_bytes(bytes(data))
    with pytest.raises(UnreadableFile, match=r"round-0002\.pt is damaged .*cannot be restored"):
        restore(RecordDict(), where, 3, training=True)


def test_deleted_snapshots_are_refused_not_a_silent_fresh_start(tmp_path):
    """A node's folder for the run exists only once it wrote a snapshot: with its snapshots
    deleted, a restarted node says so (and how to start afresh) instead of training from scratch;
    a first snapshot whose write never finished (its temporary file left over) is a fresh start."""
    import pytest

    from fedvlm.utils.files import UnreadableFile

    where = tmp_path / "node"
    state = RecordDict()
    for r in (1, 2):
        _train_round(state, where, r)
    for snapshot in where.glob("round-*.pt"):
        snapshot.unlink()
    with pytest.raises(UnreadableFile, match=r"snapshots \(round-NNNN\.pt\) are gone.*remove the folder"):
        restore(RecordDict(), where, 3, training=True)
    (where / ".round-0001.pt.abc.tmp").write_bytes(b"")  # a crash in the node's first persist
    assert restore(RecordDict(), where, 3, training=True) is None
    where.joinpath(".round-0001.pt.abc.tmp").unlink()
    where.rmdir()  # the documented way to start this node afresh
    assert restore(RecordDict(), where, 3, training=True) is None
