"""``pdserve generate`` as a user runs it: a subprocess, real model, JSON out.

Every run is started once, concurrently, when the module begins (a model load
takes seconds each); each test then waits for the run it checks. Bad input
must give a one-line message naming the problem and a non-zero exit, never a
traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

GOOD = [
    {"prompt": "The capital of France is"},
    {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 4},
    {"prompt": "def add(a, b):\n    return"},
]
WITH_BAD_LINE = [json.dumps(GOOD[0]), json.dumps(GOOD[1]), "{not json", json.dumps(GOOD[2])]
TOO_LONG = "one two three four five six seven eight nine ten " * 8
BAD_LINES = {  # line -> what its error message must name
    "empty": ({"prompt": ""}, "prompt is empty"),
    "too-long": ({"prompt": TOO_LONG}, "context is 64 tokens"),
    "max_tokens-0": ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    "messages-not-a-list": ({"messages": "hello"}, "messages"),
    "unknown-key": ({"prompt": "x", "temprature": 0.5}, "unknown keys ['temprature']"),
    "both-prompt-and-messages": ({"prompt": "x", "messages": []}, "exactly one of 'prompt' or 'messages'"),
}
WRONG_TYPES = {  # valid JSON, wrong type for the parameter
    "temperature-str": ({"prompt": "x", "temperature": "hot"}, "temperature"),
    "top_p-null": ({"prompt": "x", "top_p": None}, "top_p"),
    "stop-int": ({"prompt": "x", "stop": 5}, "stop"),
}


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str

    @property
    def json_lines(self) -> list[dict]:
        return [json.loads(line) for line in self.stdout.splitlines() if line.strip()]


class Runs:
    """Subprocesses started together; ``result(name)`` waits for one."""

    def __init__(self):
        self._procs: dict[str, subprocess.Popen] = {}
        self._results: dict[str, Result] = {}

    def start(self, name: str, *args: str, env: dict | None = None) -> None:
        # one thread each: several runs share the CPU, and spinning OpenMP workers would stall them
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self._procs[name] = subprocess.Popen([sys.executable, "-m", "services.cli", "generate", *args], cwd=REPO,
                                             env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(self, name: str) -> Result:
        if name not in self._results:
            out, err = self._procs[name].communicate(timeout=300)
            self._results[name] = Result(self._procs[name].returncode, out, err)
        return self._results[name]

    def stop(self) -> None:
        for p in self._procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()


def write_lines(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("cli")
    r = Runs()
    fast = ["--prompt", "hi", "--model", str(tmp / "never-loaded")]  # flag errors must come first
    r.start("max-tokens-0", *fast, "--max-tokens", "0")
    r.start("temperature-neg", *fast, "--temperature", "-1")
    r.start("top-p-0", *fast, "--top-p", "0")
    r.start("top-p-1.5", *fast, "--top-p", "1.5")
    r.start("spec-k-0", *fast, "--speculative", "ngram", "--num-speculative-tokens", "0")
    r.start("spec-lookup", *fast, "--speculative", "ngram", "--prompt-lookup-min", "5")
    r.start("missing-model", "--prompt", "hi", "--model", str(tmp / "no-such-model"))
    bad_gguf = tmp / "broken.gguf"
    bad_gguf.write_bytes(b"GGUX" + os.urandom(256))
    r.start("corrupt-gguf", "--prompt", "hi", "--model", str(bad_gguf), env={"PDSERVE_CACHE_DIR": str(tmp / "cache")})
    # the model-loading runs only when a test that reads them was selected
    if any(item.module is request.module and item.get_closest_marker("slow") for item in request.session.items):
        small = ["--kv-cache-gb", "0.05", "--max-tokens", "6"]
        r.start("mixed-file", "--json", "--prompts-file", write_lines(tmp / "mixed.jsonl", WITH_BAD_LINE), *small)
        bad = [json.dumps(line) for line, _ in [*BAD_LINES.values(), *WRONG_TYPES.values()]]
        r.start("bad-lines", "--json", "--max-model-len", "64", "--prompts-file",
                write_lines(tmp / "bad.jsonl", bad + [json.dumps({"prompt": "Hello"})]), *small)
    yield r
    r.stop()


def assert_clean_failure(res: Result, *must_name: str) -> None:
    assert res.rc != 0
    assert "Traceback" not in res.stderr, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert errors, res.stderr
    for name in must_name:
        assert any(name in line for line in errors), f"no error line names {name!r}:\n{res.stderr}"


# ---- failures before any model loads ---------------------------------------------------------


@pytest.mark.parametrize("name, param", [("max-tokens-0", "max_tokens must be an integer >= 1, got 0"),
                                         ("temperature-neg", "temperature must be >= 0"),
                                         ("top-p-0", "top_p must be in (0, 1], got 0.0"),
                                         ("top-p-1.5", "top_p must be in (0, 1], got 1.5")])
def test_bad_sampling_flag_fails_before_the_model_loads(runs, name, param):
    res = runs.result(name)
    assert_clean_failure(res, param)
    assert res.rc == 2  # a usage error
    # the --model given does not exist: reaching it would have been a different error
    assert "not found" not in res.stderr and "[pdserve] loaded" not in res.stderr
    assert res.stdout == ""


@pytest.mark.parametrize("name, message", [("spec-k-0", "num_speculative_tokens must be in [1, 32], got 0"),
                                           ("spec-lookup", "need 1 <= prompt_lookup_min <= prompt_lookup_max")])
def test_bad_speculative_flag_fails_before_the_model_loads(runs, name, message):
    res = runs.result(name)
    assert_clean_failure(res, message)
    assert res.rc == 2
    assert "not found" not in res.stderr and "[pdserve] loaded" not in res.stderr


def test_missing_model_path(runs):
    res = runs.result("missing-model")
    assert_clean_failure(res, "no-such-model' not found")


def test_corrupt_gguf(runs):
    res = runs.result("corrupt-gguf")
    assert_clean_failure(res, "cannot read GGUF file", "broken.gguf")
    assert res.stdout == ""


# ---- with the real model -----------------------------------------------------------------------


@pytest.mark.slow
def test_json_results_in_input_order_despite_a_bad_line(runs, default_tokenizer):
    tok = default_tokenizer
    res = runs.result("mixed-file")
    assert res.rc == 1  # one line failed
    assert "Traceback" not in res.stderr
    out = res.json_lines
    assert len(out) == 4
    assert "not valid JSON" in out[2]["error"] and "mixed.jsonl:3" in out[2]["error"]
    assert any("mixed.jsonl:3" in line for line in res.stderr.splitlines() if line.startswith("error:"))

    good = [out[0], out[1], out[3]]
    expected_prompt_tokens = [len(tok.encode(GOOD[0]["prompt"])), len(tok.apply_chat_template(GOOD[1]["messages"])),
                              len(tok.encode(GOOD[2]["prompt"]))]
    for spec, r, n_prompt in zip(GOOD, good, expected_prompt_tokens):
        assert {"text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens", "ttft_s",
                "total_s"} <= set(r)
        assert r["prompt_tokens"] == n_prompt  # so the objects are in input order
        assert r["completion_tokens"] == len(r["token_ids"]) > 0
        assert r["completion_tokens"] <= spec.get("max_tokens", 6)
        assert r["finish_reason"] in ("stop", "length")
        assert r["finish_reason"] == "stop" or r["completion_tokens"] == spec.get("max_tokens", 6)
        assert r["text"] == tok.decode(r["token_ids"])
        assert 0 < r["ttft_s"] <= r["total_s"]
    assert "Paris" in good[0]["text"]


@pytest.mark.slow
@pytest.mark.parametrize("case", BAD_LINES)
def test_bad_prompt_line_names_the_problem(runs, case):
    res = runs.result("bad-lines")
    assert res.rc == 1
    assert "Traceback" not in res.stderr
    out = res.json_lines
    assert len(out) == len(BAD_LINES) + len(WRONG_TYPES) + 1
    i = list(BAD_LINES).index(case)
    _, must_name = BAD_LINES[case]
    assert must_name in out[i]["error"]
    assert any(line.startswith(f"error: prompt {i}:") and must_name in line for line in res.stderr.splitlines())
    assert out[-1]["completion_tokens"] > 0  # the good line after them still ran


@pytest.mark.slow
@pytest.mark.parametrize("case", WRONG_TYPES)
def test_wrongly_typed_parameter_is_named(runs, case):
    res = runs.result("bad-lines")
    out = res.json_lines
    i = len(BAD_LINES) + list(WRONG_TYPES).index(case)
    _, must_name = WRONG_TYPES[case]
    assert "error" in out[i]
    assert out[i]["error"].startswith(must_name), out[i]["error"]
