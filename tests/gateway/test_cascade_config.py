"""``pdserve gateway --cascade``'s configuration errors: said before anything starts (no Redis is
reached here), with a non-zero exit, naming what is wrong."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("args, message", [
    (["--cascade", "SmolLM2-135M-Instruct,dummy:tiny"], "not served here"),
    (["--model", "default", "--model", "dummy:tiny", "--cascade", "SmolLM2-135M-Instruct,dummy:tiny"],
     "another vocabulary"),
    (["--model", "dummy:smollm2-135m", "--model", "default", "--cascade", "dummy:smollm2-135m,SmolLM2-135M-Instruct"],
     "has no tokenizer"),
    (["--model", "default", "--cascade", "SmolLM2-135M-Instruct"], "two or more"),
])
def test_a_bad_cascade_stops_the_gateway_with_a_message(args, message):
    out = subprocess.run([sys.executable, "-m", "services.cli", "gateway", *args, "--redis-url", "redis://127.0.0.1:1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert message in out.stderr + out.stdout
    assert "Traceback" not in out.stderr
