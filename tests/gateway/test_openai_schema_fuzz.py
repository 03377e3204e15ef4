"""Requests generated from OpenAI's published schemas (schemathesis), valid and invalid, against the gateway.

For every operation pdserve serves, a bounded number of examples of each kind:
schema-valid bodies (which pdserve must answer with 2xx, or a 4xx naming what it
does not support) and schema-violating ones (a 4xx). Whatever the body: no 5xx,
no connection reset, no hang (each call has a timeout), every answer conforms
to the schemas, and afterwards ordinary requests are still served.
"""

from __future__ import annotations

import copy
import json

import httpx
import openai
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from services.gateway.spec_fields import ENDPOINTS, REFUSED
from tests.gateway.fake_router import DEFAULT_PIECES
from tests.openai_spec.validator import SPEC_PATH

EXAMPLES = 12  # per operation and mode: seconds in CI; raise locally with PDSERVE_FUZZ_EXAMPLES
COVERAGE_STRIDE = 3  # of schemathesis' coverage cases (one per schema keyword and wrong type), send every 3rd
CALL_TIMEOUT_S = 30


def _examples() -> int:
    import os

    return int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", EXAMPLES))


def _schema():
    doc = copy.deepcopy(json.loads(SPEC_PATH.read_text()))
    doc["servers"] = [{"url": "/v1"}]
    return schemathesis.openapi.from_dict(doc)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_fuzzed_requests_never_break_the_gateway(gateway, openai_contract, mode):
    h = gateway(model_len=4096)
    session = requests.Session()  # keep-alive: a request after an error must find its connection usable
    seen: dict[str, list[int]] = {}
    operations = [result.ok() for result in _schema().get_all_operations()]
    assert len(operations) == 6
    if mode is GenerationMode.NEGATIVE:  # the GETs take only free strings: nothing there can be invalid
        operations = [op for op in operations if op.method == "post"]
    for operation in operations:
        label = f"{operation.method.upper()} {operation.path}"

        @settings(max_examples=_examples(), deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=[Phase.generate])
        @given(case=operation.as_strategy(generation_mode=mode))
        def call(case):
            response = case.call(base_url=f"{h.url}/v1", session=session, timeout=CALL_TIMEOUT_S)
            seen.setdefault(label, []).append(response.status_code)
            assert response.status_code < 500, f"{label}: {response.status_code} {response.text[:300]}"
            content_type = (response.headers.get("content-type") or [""])[0]  # schemathesis: lists of values
            openai_contract.check_body(case.method, f"/v1{case.formatted_path}", response.status_code,
                                       content_type, response.content)
            if mode is GenerationMode.NEGATIVE and response.status_code >= 400:
                assert response.json()["error"]["message"]

        call()
    assert set(seen) == {f"{op.method.upper()} {op.path}" for op in operations}
    # ordinary requests are still served, on the fuzzer's connection and on a new one
    r = session.post(f"{h.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]},
                     timeout=CALL_TIMEOUT_S)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "".join(DEFAULT_PIECES)
    with openai.OpenAI(base_url=f"{h.url}/v1", api_key="unused", max_retries=0) as client:
        assert client.responses.create(input="Hi").output_text == "".join(DEFAULT_PIECES)
    assert httpx.get(f"{h.url}/health", timeout=10).status_code == 200


def _past_refusals(body, operation, model: str):
    """The body without the fields pdserve refuses and with the served model: OpenAI's examples fill
    every optional field, so as generated the refusal of one (a 400) hides what the parser would
    do with the broken keyword behind it."""
    fields = ENDPOINTS.get(f"POST /v1{operation.path}")
    if not isinstance(body, dict) or fields is None:
        return None
    kept = {k: v for k, v in body.items() if not (k in fields and fields[k].status == REFUSED)}
    return {**kept, "model": model} if "model" in kept else kept


def test_coverage_cases_of_every_request_keyword_are_4xx(gateway, openai_contract):
    """schemathesis' coverage phase: for each keyword of the request schemas, a value that breaks it
    (a wrong type, a missing required field, a value out of range: a role that is an object, say),
    as generated and without the fields pdserve refuses. Every one is refused with a 4xx naming a
    problem, or served; none is a 5xx or a reset."""
    h = gateway(model_len=4096)
    schema = _schema()
    session = requests.Session()
    sent = 0
    for operation in (result.ok() for result in schema.get_all_operations()):
        if operation.method != "post":
            continue
        config = schema.config.generation_for(operation=operation)
        cases = schema.iter_coverage_cases(operation, generation_modes=[GenerationMode.NEGATIVE],
                                           generation_config=config)
        for i, case in enumerate(cases):
            if i % COVERAGE_STRIDE:
                continue
            for body in (case.body, _past_refusals(case.body, operation, h.model.name)):
                if body is None:
                    continue
                case.body = body
                response = case.call(base_url=f"{h.url}/v1", session=session, timeout=CALL_TIMEOUT_S)
                sent += 1
                label = f"{operation.method.upper()} {operation.path} {body!r:.200}"
                assert response.status_code < 500, f"{label}: {response.status_code} {response.text[:300]}"
                content_type = (response.headers.get("content-type") or [""])[0]
                openai_contract.check_body(case.method, f"/v1{case.formatted_path}", response.status_code,
                                           content_type, response.content)
    assert sent > 300
    r = session.post(f"{h.url}/v1/completions", json={"prompt": "Hi"}, timeout=CALL_TIMEOUT_S)
    assert r.status_code == 200
