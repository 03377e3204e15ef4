"""`pdserve bench kvtransfer --peer`: the receiver in a process started on its own (in compose: another
container), reached over the network; the transferred blocks are verified byte for byte."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_run_against_a_separately_started_receiver_verifies_its_blocks():
    peer = subprocess.Popen([sys.executable, "-m", "services.cli", "bench", "kvtransfer", "--serve-peer",
                             "127.0.0.1:0"], stderr=subprocess.PIPE, text=True)
    try:
        line = peer.stderr.readline()
        port = re.search(r"on 127\.0\.0\.1:(\d+)", line).group(1)
        run = subprocess.run([sys.executable, "-m", "services.cli", "bench", "kvtransfer", "--peer",
                              f"127.0.0.1:{port}", "--tokens", "256", "--repeats", "1", "--transports", "tcp",
                              "--json"], capture_output=True, text=True, timeout=240)
        assert run.returncode == 0, run.stderr[-2000:]
        result = json.loads(run.stdout.strip().splitlines()[-1])
        assert result["verified"] and result["peer"] == f"127.0.0.1:{port}"
        assert result["sizes"]["256"]["tcp_gbps"] > 0
        assert peer.wait(30) == 0  # served one run, then exited
    finally:
        if peer.poll() is None:
            peer.kill()
