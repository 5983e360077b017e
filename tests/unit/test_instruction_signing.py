"""A node acts only on instructions its federation's ServerApp signed
(deploy.instruction_signing): a message signed on the ServerApp side verifies on the node after
travelling as Flower's objects; another key, a changed content, another destination node or
run, a missing signature, each is refused."""

from __future__ import annotations

import stat

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

from fedvlm.deploy.instruction_signing import (
    SIGNATURE,
    UnsignedInstruction,
    generate,
    load_private,
    load_public,
    sign_pushes,
    signed,
    verify,
)


@pytest.fixture
def keys(tmp_path):
    generate(tmp_path / "server-signing.key", tmp_path / "server-signing.pub")
    generate(tmp_path / "other.key", tmp_path / "other.pub")
    return {
        "private": load_private(tmp_path / "server-signing.key"),
        "public": load_public(tmp_path / "server-signing.pub"),
        "other": load_private(tmp_path / "other.key"),
        "dir": tmp_path,
    }


def _content() -> RecordDict:
    return RecordDict(
        {
            "arrays": ArrayRecord({"ctx": Array(np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32))}),
            "config": ConfigRecord({"server-round": 3, "dp.local-sigma": 0.5}),
        }
    )


def _message(content: RecordDict, dst: int = 1001, run: int = 7) -> Message:
    msg = Message(content, dst_node_id=dst, message_type="train", group_id="3")
    msg.metadata.__dict__["_run_id"] = run
    return msg


def _travelled(msg: Message) -> Message:
    """``msg`` as a node's ClientApp inflates it from the objects the SuperLink serves."""
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(msg).items()}
    got = inflate_object_from_contents(msg.object_id, contents)
    assert isinstance(got, Message)
    return got


def test_the_private_key_is_owner_only(keys):
    path = keys["dir"] / "server-signing.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    with pytest.raises(PermissionError, match="readable by others: chmod 600"):
        load_private(path)


def test_a_signed_instruction_verifies_on_the_node(keys):
    verify(_travelled(signed(_message(_content()), keys["private"])), [keys["public"]])


def test_what_is_not_the_servers_instruction_is_refused(keys):
    with pytest.raises(UnsignedInstruction, match="carries no signature"):
        verify(_travelled(_message(_content())), [keys["public"]])
    forged = signed(_message(_content()), keys["other"])  # another organisation's own key
    with pytest.raises(UnsignedInstruction, match="not signed by this node's pinned ServerApp key"):
        verify(_travelled(forged), [keys["public"]])
    # a signed message changed afterwards: other arrays, another node, another run
    genuine = signed(_message(_content()), keys["private"])
    changed = RecordDict(dict(genuine.content.items()))
    changed["arrays"] = ArrayRecord({"ctx": Array(np.zeros((16, 64), np.float32))})
    redirected = [_message(changed), _message(genuine.content, dst=1002), _message(genuine.content, run=8)]
    for msg in redirected:
        with pytest.raises(UnsignedInstruction, match="or was changed after signing"):
            verify(_travelled(msg), [keys["public"]])


def test_every_pushed_message_is_signed_with_a_content_of_its_own(keys):
    """Strategies may share one RecordDict between a round's messages: each gets its own copy,
    signed for its own destination."""

    class Grid:
        def __init__(self):
            self.pushed: list[Message] = []

        def push_messages(self, messages):
            self.pushed.extend(messages)
            return [str(i) for i, _ in enumerate(self.pushed)]

    grid, shared = Grid(), _content()
    sign_pushes(grid, keys["private"])
    grid.push_messages([_message(shared, dst=d) for d in (1001, 1002)])
    assert SIGNATURE not in shared
    for msg in grid.pushed:
        verify(_travelled(msg), [keys["public"]])
    one, two = grid.pushed
    assert one.content is not two.content and one.content[SIGNATURE]["signature"] != two.content[SIGNATURE]["signature"]


def test_a_node_serves_each_signed_instruction_once(keys, tmp_path):
    """A signed instruction carried no nonce: replayed, it was valid for its whole run, to its
    node, any number of times, each replay a fresh release charged to the node's ledger. Now
    each carries a signed nonce, and the node refuses one it served before; a nonce changed to
    get past that breaks the signature."""
    from flwr.app import ConfigRecord

    from fedvlm.deploy.instruction_signing import Served

    served = Served(tmp_path / "served")
    genuine = signed(_message(_content()), keys["private"])
    verify(_travelled(genuine), [keys["public"]], served)
    with pytest.raises(UnsignedInstruction, match="served by this node before.*refused before the app ran"):
        verify(_travelled(genuine), [keys["public"]], served)
    again = signed(_message(_content()), keys["private"])  # the same instruction signed again: a new nonce
    assert again.content[SIGNATURE]["nonce"] != genuine.content[SIGNATURE]["nonce"]
    verify(_travelled(again), [keys["public"]], served)
    record = dict(genuine.content[SIGNATURE].items())
    renamed = RecordDict(dict(genuine.content.items()))
    renamed[SIGNATURE] = ConfigRecord({**record, "nonce": "00" * 16})
    with pytest.raises(UnsignedInstruction, match="or was changed after signing"):
        verify(_travelled(_message(renamed)), [keys["public"]], served)
    # the record is the node's, owner-only, one file per run; another run's messages are apart
    assert stat.S_IMODE((tmp_path / "served").stat().st_mode) == 0o700
    assert [p.name for p in (tmp_path / "served").glob("*.json")] == ["run-7.json"]
