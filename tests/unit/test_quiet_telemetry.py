"""deploy.quiet_telemetry: no event built where Flower would drop it, Flower's own where it sends or logs."""

from __future__ import annotations

import platform

import pytest

from fedvlm.deploy import quiet_telemetry


@pytest.fixture
def telemetry(monkeypatch):
    from flwr.supercore import telemetry

    monkeypatch.setattr(telemetry, "create_event", telemetry.create_event)  # restored after the test
    return telemetry


def _described(monkeypatch) -> list[str]:
    """Each call Flower's event makes to describe the platform (the expensive part)."""
    calls: list[str] = []
    real = platform.architecture
    monkeypatch.setattr(platform, "architecture", lambda *a, **k: calls.append("architecture") or real(*a, **k))
    return calls


def test_an_event_neither_sent_nor_logged_is_not_built(telemetry, monkeypatch):
    monkeypatch.setattr(telemetry, "FLWR_TELEMETRY_ENABLED", "0")
    monkeypatch.setattr(telemetry, "FLWR_TELEMETRY_LOGGING", "0")
    calls = _described(monkeypatch)
    flower_answer = telemetry.create_event(telemetry.EventType.FLWR_CLIENTAPP_RUN_ENTER, None)
    assert calls == ["architecture"]  # Flower's builds it, then answers
    assert quiet_telemetry.install() and quiet_telemetry.install()  # twice: still one patch
    answer = telemetry.event(telemetry.EventType.FLWR_CLIENTAPP_RUN_ENTER).result(timeout=10)
    assert answer == flower_answer == "disabled" and calls == ["architecture"]


@pytest.mark.parametrize("setting", ["FLWR_TELEMETRY_ENABLED", "FLWR_TELEMETRY_LOGGING"])
def test_an_operator_who_turns_telemetry_on_gets_flowers_event(telemetry, monkeypatch, setting):
    monkeypatch.setattr(telemetry, "FLWR_TELEMETRY_ENABLED", "0")
    monkeypatch.setattr(telemetry, "FLWR_TELEMETRY_LOGGING", "0")
    monkeypatch.setattr(telemetry, setting, "1")
    flowers = telemetry.create_event
    assert not quiet_telemetry.install()
    assert telemetry.create_event is flowers


def test_a_flower_that_sends_otherwise_is_left_alone(telemetry, monkeypatch):
    def create_event(event_type, event_details):  # sends whatever the settings say
        return "sent"

    monkeypatch.setattr(telemetry, "FLWR_TELEMETRY_ENABLED", "0")
    monkeypatch.setattr(telemetry, "FLWR_TELEMETRY_LOGGING", "0")
    monkeypatch.setattr(telemetry, "create_event", create_event)
    quiet_telemetry.check_flower.cache_clear()
    try:
        assert "no longer sends" in (quiet_telemetry.check_flower() or "")
        assert not quiet_telemetry.install() and telemetry.create_event is create_event
    finally:
        quiet_telemetry.check_flower.cache_clear()
