"""Publishing a client's personalised prompt at the end of a run.

In DP-FPL's threat model a client hands its trained prompt to users, and that prompt is
what membership-inference attacks target. On the last round the client writes its prompts
(the tensors it evaluates with) to a file on ITS OWN disk; nothing crosses the network.

Where: the node config's ``publish-dir`` if set (a deployed organisation chooses); else, for
a simulated node (one with a partition id), ``published/`` in the run folder the server names;
a deployed node without ``publish-dir`` publishes nothing.
"""

from __future__ import annotations

from pathlib import Path

from fedvlm.protocol import PUBLISH_DIR, EvaluateInstruction
from fedvlm.utils.files import atomic_torch_save


def publish_dir(node_config: dict, instruction: EvaluateInstruction, partition_id: int) -> Path | None:
    if node_config.get(PUBLISH_DIR):
        return Path(str(node_config[PUBLISH_DIR])).expanduser()
    if partition_id >= 0 and instruction.run_dir:
        return Path(instruction.run_dir) / "published"
    return None


def publish(node, published: dict | None, instruction: EvaluateInstruction) -> Path | None:
    """Write what ``node``'s client publishes (``Client.published``) where the node publishes, on
    the run's last round; the path written, or None."""
    if not instruction.final_round or not published:
        return None
    where = publish_dir(node.config, instruction, node.partition_id)
    if where is None:
        return None
    path = where / f"{node.name}.pt"
    atomic_torch_save(published, path)
    return path
