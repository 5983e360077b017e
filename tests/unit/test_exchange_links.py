"""bench/exchange_links.py's time line: a node's stamped logs read back as the links of each of
its exchanges, its first ones left out."""

from __future__ import annotations

from bench.exchange_links import SKIPPED, events, link_times


def test_each_exchange_is_read_link_by_link_from_the_nodes_stamped_logs(tmp_path):
    node, execs, worker = [], [], []
    for k in range(SKIPPED + 2):  # one exchange a second, its links 0.1, 0.2, 0.01, 0.05 s long
        t = 10.0 + k
        node += [f"@00:00:{t:06.3f} INFO Received successfully", f"@00:00:{t + 0.31:06.3f} INFO Sending: train"]
        node.append(f"@00:00:{t + 0.36:06.3f} INFO Sent successfully")
        execs.append(f"@00:00:{t + 0.1:06.3f} INFO Start `flwr-clientapp` process")
        worker.append(f"@00:00:{t + 0.3:06.3f} x INFO served train of run 1 for node 2 in 0.01 s")
    node.append("unstamped lines are skipped: Received successfully")
    for name, lines in (("org-0.log", node), ("org-0-exec.log", execs), ("org-0-worker.log", worker)):
        (tmp_path / name).write_text("\n".join(lines))
    times = link_times(events(tmp_path, "org-0"))
    got = {name: [round(v, 3) for v in values] for name, values in times.items()}
    assert got == {  # the last exchange has no next one; the first SKIPPED are left out
        "received -> ClientApp started": [0.1],
        "ClientApp started -> worker served": [0.2],
        "worker served -> reply sending": [0.01],
        "reply sending -> sent": [0.05],
        "sent -> next received": [0.64],
    }
