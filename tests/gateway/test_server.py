"""``pdserve gateway`` as a process: flags, the ready line other tooling parses, health, a clean SIGTERM."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time

import httpx
import pytest

from services.gateway import server

# services/cli.py does not list the gateway yet: build the same subcommand the way it would
_MAIN = ("import argparse, sys; from services.gateway import server; p = argparse.ArgumentParser(); "
         "server.add_parser(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))")


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    server.add_parser(parser.add_subparsers())
    return parser.parse_args(["gateway", *argv])


def test_flags_build_the_config():
    args = _parse()
    assert (args.host, args.port, args.grpc_port, args.api_keys) == ("127.0.0.1", 8000, 50052, None)
    config = server.build_config(_parse("--max-queued-requests", "7", "--max-queued-tokens", "900",
                                        "--max-body-bytes", "4096", "--max-model-len", "512",
                                        "--disconnect-grace", "0", "--allow-no-worker"))
    assert (config.max_queued_requests, config.max_queued_tokens, config.max_body_bytes, config.max_model_len,
            config.disconnect_grace_s, config.require_ready_worker) == (7, 900, 4096, 512, 0, False)
    assert config.queue_config().max_queued_requests == 7
    with pytest.raises(ValueError):
        server.build_config(_parse("--max-body-bytes", "0"))


@pytest.mark.slow
def test_gateway_process_prints_ready_serves_and_stops_on_sigterm(redis_url, sync_redis):
    proc = subprocess.Popen([sys.executable, "-c", _MAIN, "gateway", "--port", "0", "--grpc-port", "0",
                             "--redis-url", redis_url], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        address, lines = None, []
        give_up = time.monotonic() + 180
        while address is None and time.monotonic() < give_up:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith(server.READY_PREFIX):
                address = line[len(server.READY_PREFIX):].split()[0]
        assert address, "".join(lines[-20:])
        with httpx.Client(base_url=f"http://{address}", timeout=10) as http:
            assert http.get("/health/live").status_code == 200
            ready = http.get("/health/ready")  # the database is empty: no decode worker
            assert ready.status_code == 503 and "Retry-After" in ready.headers
            assert http.post("/v1/completions", json={"prompt": "Hi"}).status_code == 503
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
