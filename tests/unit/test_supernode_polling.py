"""The SuperNode polling shim: it applies to the installed Flower, changes only the two waits it
names, and leaves a Flower it does not know alone."""

from __future__ import annotations

import time
import types

import pytest

from fedvlm.deploy import supernode_polling as polling


def test_installed_flower_is_the_loop_the_shim_knows():
    # fails on a Flower upgrade that moved the SuperNode's waits: revisit supernode_polling then
    import flwr.supernode.start_client_internal as loop

    assert polling.check_flower(loop) is None


def test_install_swaps_only_the_two_waits(monkeypatch):
    import flwr.supernode.start_client_internal as loop

    monkeypatch.setattr(loop, "time", time)  # undone after the test, like the install below
    assert polling.install(0.05, 0.01)
    clock = loop.time
    assert isinstance(clock, polling.PollingClock)
    slept: list[float] = []
    monkeypatch.setattr(polling.time, "sleep", slept.append)
    clock.sleep(3)
    clock.sleep(0.5)
    clock.sleep(0.2)  # any other wait is Flower's own
    assert slept == [0.05, 0.01, 0.2]
    assert clock.monotonic is time.monotonic and clock.time is time.time


def test_a_flower_loop_that_changed_runs_unchanged(monkeypatch, caplog):
    source = "import time\n\ndef loop():\n    time.sleep(5)\n    time.sleep(0.5)\n    time.sleep(0.5)\n"
    changed = types.ModuleType("changed_loop")
    exec(compile(source, "<changed>", "exec"), changed.__dict__)
    monkeypatch.setattr(polling.inspect, "getsource", lambda module: source)
    assert "time.sleep(3)" in polling.check_flower(changed)
    import flwr.supernode.start_client_internal as loop

    monkeypatch.setattr(loop, "time", time)
    monkeypatch.setattr(polling.inspect, "getsource", lambda module: source)
    assert not polling.install(0.5, 0.1)
    assert loop.time is time
    assert "running it with its own waits" in caplog.text


@pytest.mark.parametrize("idle, reply", [(0, 0.1), (4, 0.1), (0.5, 0), (0.5, 0.6), (float("nan"), 0.1)])
def test_waits_outside_flowers_own_are_refused(idle, reply):
    with pytest.raises(ValueError, match="--idle-poll must be in"):
        polling.PollingClock(idle, reply)


def test_a_node_without_a_privacy_limit_says_so_loudly(caplog):
    with caplog.at_level("WARNING", logger="fedvlm.supernode"):
        limited = ["--superlink", "x:1", "--node-config", "data-dir='/d' max-epsilon=8 delta=1e-5 state-dir='/s'"]
        assert polling.warn_without_limit(limited) and not caplog.records
        assert not polling.warn_without_limit(["--node-config=data-dir='/d' name='org-a'"])
    (record,) = caplog.records
    assert "THIS NODE STATES NO PRIVACY LIMIT" in record.getMessage() and "max-epsilon=<limit>" in record.getMessage()


def test_the_supernode_takes_no_run_without_a_pin(capsys):
    with pytest.raises(SystemExit):
        polling.main(["--", "--superlink", "x:1"])
    assert "--pin" in capsys.readouterr().err
