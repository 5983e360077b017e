"""A seed paper's protocol end to end at CI size: its runs through the sweep, its board, and each
headline's verdict from the runs' own figures (paired by seed), written whole."""

from __future__ import annotations

import json

import pytest

from fedvlm.experiments import protocols, stats


def test_a_protocol_judges_its_headlines_from_its_runs(tmp_path, cache_dir, pretrained_clip, monkeypatch):
    monkeypatch.setenv("FEDVLM_CACHE", str(cache_dir))
    argv = ["paper-dpfpl", "--quick", "--variants", "promptfl,dpfpl-r8", "--epsilons", "0.1", "--seeds", "0,1"]
    assert protocols.main([*argv, "--no-attacks", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "paper-dpfpl.json").read_text())
    rows = {(e["variant"], e["epsilon"]): e for e in saved["entries"]}
    assert set(rows) == {("promptfl", "0.1"), ("dpfpl-r8", "0.1")} and {e["seeds"] for e in rows.values()} == {2}
    local, neighbour, *others = saved["headlines"]  # the two this call's rows compare, first
    # the local-accuracy headline, recomputed from the runs' own results.json
    acc = {
        (v, s): json.loads((tmp_path / "paper-dpfpl" / "runs" / f"{v}-eps0.1-seed{s}" / "results.json").read_text())[
            "final"
        ]["local-acc-last10-mean"]
        for v in ("promptfl", "dpfpl-r8")
        for s in (0, 1)
    }
    expected = stats.difference({s: acc["dpfpl-r8", s] for s in (0, 1)}, {s: acc["promptfl", s] for s in (0, 1)})
    assert local["difference"]["mean"] == pytest.approx(expected.mean)
    assert local["difference"]["ci95"] == pytest.approx([expected.low, expected.high])
    assert local["outcome"] in ("reproduced", "reversed", "not measurable") and neighbour["outcome"]
    # rows the call did not make cannot settle a headline: every other one, at either privacy level
    assert len(others) == len(protocols.PROTOCOLS["paper-dpfpl"].headlines) - 2
    assert {h["outcome"] for h in others} == {"not measurable"} and all("was not run" in h["why"] for h in others)
    page = (tmp_path / "paper-dpfpl.md").read_text()
    assert "## Headlines" in page and "CPU budget:" in page and f"**{local['outcome']}**" in page
    # each headline's figure per row, the runs' own mean over the two seeds
    mean = (acc["promptfl", 0] + acc["promptfl", 1]) / 2
    assert "`local-acc-last10-mean` per row" in page and f"| promptfl | {100 * mean:.2f} ± " in page
