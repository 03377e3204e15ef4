"""``pdserve bench coalesce``'s own arithmetic: what it reads from /metrics, and what its dummy-model
requests look like to the load generator (a model without a tokenizer streams tokens as logprobs)."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from services.bench.load import _StreamState
from services.gateway.coalesce_bench import _request, metric_total, workload

METRICS = """# HELP pdserve_phase_seconds x
pdserve_phase_seconds_count{role="decode",phase="forward_decode"} 120.0
pdserve_phase_seconds_sum{role="decode",phase="forward_decode"} 6.5
pdserve_phase_seconds_count{role="decode",phase="forward_prefill"} 7.0
pdserve_batch_size_sum{role="decode"} 900.0
pdserve_generation_tokens_total{role="decode",worker="w1"} 40.0
pdserve_generation_tokens_total{role="decode",worker="w2"} 2.0
"""


@pytest.fixture
def metrics_address():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(METRICS.encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_metric_total_sums_the_series_whose_labels_match(metrics_address):
    assert metric_total(metrics_address, "pdserve_generation_tokens_total") == 42.0
    assert metric_total(metrics_address, "pdserve_phase_seconds_count", 'phase="forward_decode"') == 120.0
    assert metric_total(metrics_address, "pdserve_phase_seconds_sum", 'phase="forward_decode"') == 6.5
    assert metric_total(metrics_address, "pdserve_phase_seconds_count", 'phase="mixed"') == 0.0


def test_a_dummy_model_request_is_token_ids_whose_tokens_stream_as_logprobs():
    prompts = workload(seed=3, requests=10, share=0.3, gap=2, words=12)
    assert len(prompts) == 10 and len(set(prompts)) == 7  # three copies of earlier prompts
    item = _request(prompts[0], 4, dummy=True)
    assert item.api == "completion" and item.extra["logprobs"] == 0
    assert all(isinstance(t, int) and 0 <= t < 32000 for t in item.prompt)
    assert len(item.prompt) == len(prompts[0].split())  # one id per word
    assert _request(prompts[0], 4, dummy=True).prompt == item.prompt  # the same prompt, the same ids
    # the gateway's chunks for a model without a tokenizer: no text, one token's logprob each
    state = _StreamState("completion", 0.0, False)
    for _ in range(4):
        state.on_event("1-0", json.dumps({"choices": [{"text": "", "logprobs": {"tokens": [""]}}]}), 0.0)
    state.on_event("1-1", json.dumps({"choices": [], "usage": {"completion_tokens": 4}}), 0.0)
    state.on_event("1-1", "[DONE]", 0.0)
    sample = state.sample(1.0)
    assert sample.ok and sample.tokens == 4 and len(sample.gaps) == 3
