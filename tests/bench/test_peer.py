"""`pdserve bench peer`: finding llama-server, saying how to get it, and the ratios it reports.

CI has no llama-server binary (building it takes minutes), so the run here is the one a user
without it gets: the bench says how to build it and measures `pdserve up` with its defaults
alone, every request served and greedy outputs the same batched as alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.bench import llama_server, peer

REPO = Path(__file__).resolve().parents[2]


def _no_llama_env(tmp_path: Path) -> dict:
    """An environment in which no llama-server can be found: an empty cache dir, PATH without one."""
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and not (Path(p) / "llama-server").exists())
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_LLAMA_SERVER"}
    return {**env, "PDSERVE_LLAMA_SERVER_DIR": str(tmp_path / "none"), "PATH": path}


def test_the_binary_is_found_where_the_build_script_puts_it(tmp_path, monkeypatch):
    monkeypatch.delenv("PDSERVE_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PDSERVE_LLAMA_SERVER_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", _no_llama_env(tmp_path)["PATH"])
    assert llama_server.find() is None
    binary = tmp_path / "0.3.36-native" / "llama-server"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert llama_server.find() == binary
    with pytest.raises(ValueError, match="not an executable"):
        llama_server.find(str(tmp_path / "missing"))
    # the script the message names is in the repo, executable
    assert "scripts/build_llama_server.sh" in llama_server.HOW_TO_GET
    assert os.access(REPO / "scripts" / "build_llama_server.sh", os.X_OK)


def _server(rows: dict) -> dict:
    return {"levels": [{"concurrency": c, "fresh": {"output_tok_s": tok, "ttft_ms_p90": p90, "ttft_ms_p50": p50},
                        "cached": {"output_tok_s": tok, "ttft_ms_p90": p90 / 10, "ttft_ms_p50": p50 / 10}}
                       for c, (tok, p50, p90) in rows.items()]}


def test_ratios_are_pdserve_over_llama_server_at_the_named_levels():
    ours = _server({1: (50.0, 100.0, 200.0), 16: (300.0, 400.0, 800.0), 32: (320.0, 500.0, 1000.0)})
    theirs = _server({1: (100.0, 50.0, 100.0), 16: (150.0, 800.0, 1600.0), 32: (160.0, 1000.0, 4000.0)})
    got = peer.ratios(ours, theirs)
    assert got == {"throughput_ratio_c1": 0.5, "throughput_ratio_c16": 2.0, "throughput_ratio_c32": 2.0,
                   "ttft_p90_ratio_c16": 0.5, "ttft_p90_ratio_c32": 0.25, "cached_ttft_p50_ratio_c1": 2.0,
                   "cached_ttft_p90_ratio_c16": 0.5}
    # a level that did not run has no ratio rather than a made-up one
    del theirs["levels"][2]
    assert peer.ratios(ours, theirs)["throughput_ratio_c32"] is None


def test_prompts_differ_from_their_first_words_and_between_levels():
    a, b = peer.workload(0, 8), peer.workload(1, 8)
    assert len(set(a)) == 8 and not set(a) & set(b)
    for prompt in a:
        task = next(t for t in peer._TASKS if prompt.startswith(t))
        words = len(prompt.split()) - len(task.split()) - 2  # after the task: its index and the seed
        assert 40 <= words <= 120


@pytest.mark.slow
def test_without_llama_server_it_says_how_to_get_it_and_runs_pdserve_alone(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "bench", "peer", "--json", "--concurrency", "1,2",
         "--min-requests", "2", "--max-tokens", "6", "--check", "2", "--kv-cache-gb", "0.25",
         "--variant", "pdserve="],
        capture_output=True, text=True, timeout=600, env=_no_llama_env(tmp_path), cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "scripts/build_llama_server.sh" in done.stderr and "running pdserve alone" in done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["llama_server"]["found"] is False
    assert "build_llama_server.sh" in result["llama_server"]["how_to_get"]
    assert list(result["servers"]) == ["pdserve"] and "ratios" not in result
    assert result["errors"] == 0
    server = result["servers"]["pdserve"]
    assert server["config"]["up_flags"] == "(defaults)"
    assert [row["concurrency"] for row in server["levels"]] == [1, 2]
    for row in server["levels"]:
        for name in ("fresh", "cached"):
            r = row[name]
            assert r["requests"] == row["requests"] and r["failed"] == 0
            assert r["output_tok_s"] > 0 and 0 < r["ttft_ms_p50"] <= r["ttft_ms_p90"] <= r["ttft_ms_p99"]
    greedy = server["greedy_check"]
    assert greedy["prompts"] == 2 and greedy["batch1_failed"] == 0
    assert greedy["fresh_identical"] == 2 and greedy["cached_identical"] == 2
