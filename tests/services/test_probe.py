"""`pdserve probe`: real grpc.health.v1 and HTTP checks, and `probe self` finding the container's server."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services import probe


@pytest.fixture
def health_server():
    """A real grpc health service on a free port; yields (address, set_status)."""
    loop = asyncio.new_event_loop()
    state = {}

    async def start():
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        state.update(server=server, servicer=servicer, port=port)

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)

    def set_status(status, name=""):
        asyncio.run_coroutine_threadsafe(state["servicer"].set(name, status), loop).result(10)

    yield f"127.0.0.1:{state['port']}", set_status
    asyncio.run_coroutine_threadsafe(state["server"].stop(None), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "probe", *args], capture_output=True, text=True,
                          timeout=60)


def test_grpc_probe_follows_the_serving_status(health_server):
    address, set_status = health_server
    loading = _cli("grpc", address)
    assert loading.returncode == 1 and "NOT_SERVING" in loading.stderr  # e.g. a worker loading its model
    set_status(health_pb2.HealthCheckResponse.SERVING)
    assert _cli("grpc", address).returncode == 0
    unknown = _cli("grpc", address, "--service", "no.such.Service")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr


def test_grpc_probe_of_nothing_listening_is_unhealthy_not_a_hang():
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening
        result = _cli("grpc", f"127.0.0.1:{port}", "--timeout", "2")
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr


def test_http_probe_wants_a_2xx():
    codes = {"/ok": 200, "/busy": 503}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(codes.get(self.path, 404))
            self.end_headers()
            self.wfile.write(b'{"status": "not ready"}')

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert _cli("http", f"{base}/ok").returncode == 0
        busy = _cli("http", f"{base}/busy")
        assert busy.returncode == 1 and "503" in busy.stderr and "not ready" in busy.stderr
    finally:
        server.shutdown()


def test_self_target_reads_the_role_port_and_host_of_the_server_command():
    venv = "/opt/pdserve/venv/bin/pdserve"
    assert probe.self_target(["python3", venv, "gateway"], {}) == ("http", "http://127.0.0.1:8000/health/ready")
    assert probe.self_target(["python3", venv, "decode", "--host", "0.0.0.0", "--port", "50060"], {}) == \
        ("grpc", "127.0.0.1:50060")
    assert probe.self_target(["python3", venv, "router"], {"PDSERVE_PORT": "6000"}) == ("grpc", "127.0.0.1:6000")
    assert probe.self_target(["python", "-m", "services.cli", "prefill", "--port=7000"], {}) == \
        ("grpc", "127.0.0.1:7000")
    with pytest.raises(LookupError, match="random port"):
        probe.self_target(["python3", venv, "prefill"], {})


def test_server_command_is_pid_1_or_its_child(tmp_path):
    def proc(pid: str, argv: list[str], ppid: str) -> None:
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        (tmp_path / pid / "status").write_text(f"Name:\tx\nPPid:\t{ppid}\n")

    proc("1", ["/sbin/docker-init", "--", "pdserve", "decode"], "0")  # init's argv names it too: found first
    assert probe.server_command(tmp_path)[-1] == "decode"
    (tmp_path / "1" / "cmdline").write_bytes(b"/sbin/tini\0--\0sleep\0")
    proc("7", ["/opt/venv/bin/python3", "/opt/venv/bin/pdserve", "router"], "1")
    proc("9", ["python3", "/opt/venv/bin/pdserve", "gateway"], "7")  # a grandchild is not this container's server
    assert probe.server_command(tmp_path)[-1] == "router"
    (tmp_path / "7" / "status").write_text("PPid:\t3\n")
    with pytest.raises(LookupError, match="containers"):
        probe.server_command(tmp_path)
