"""The gateway under test, in-process: uvicorn on a free port in a background thread, on a real Redis.

``GatewayHarness`` runs one event loop in its own thread with uvicorn serving
``served_app(GatewayCore(...))`` (app.py), optionally the gRPC API, and ``FakeRouter``
(fake_router.py), which stands in for the router and the workers behind the
real admission queue and result streams.
"""

from __future__ import annotations

import asyncio
import threading
import time

import redis

from services.gateway.api_keys import ApiKeys
from services.gateway.config import GatewayConfig
from services.registry import WORKERS_KEY, WorkerInfo, connect_redis, worker_key
from tests.gateway.fake_router import FakeRouter

MODEL_LEN = 2048  # what the fake decode worker says it serves


def register_decode_worker(r: redis.Redis, max_model_len: int = MODEL_LEN, ready: bool = True,
                           worker_id: str = "decode-fake") -> None:
    info = WorkerInfo(worker_id=worker_id, role="decode", address="127.0.0.1:1", model="SmolLM2-135M-Instruct",
                      namespace="test", block_size=16, max_model_len=max_model_len, ready=ready)
    r.set(worker_key(worker_id), info.to_json(), px=600_000)
    r.sadd(WORKERS_KEY, worker_id)


class GatewayHarness:
    def __init__(self, redis_url: str, model, config: GatewayConfig, keys: ApiKeys | None, grpc: bool):
        self.redis_url = redis_url
        self.model = model
        self.config = config
        self.keys = keys
        self.grpc = grpc
        self.router: FakeRouter | None = None
        self.core = None
        self.port = self.grpc_port = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="gateway-under-test")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> GatewayHarness:
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"the gateway did not start: {self._error!r}")
        return self

    def call(self, make_coro, timeout: float = 10):
        """Run ``make_coro()`` on the gateway's event loop (where its Redis clients live)."""
        return asyncio.run_coroutine_threadsafe(make_coro(), self.loop).result(timeout)

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
            self._ready.set()
        finally:
            self.loop.close()

    async def _main(self) -> None:
        import uvicorn

        from services.gateway.app import served_app
        from services.gateway.core import GatewayCore
        from services.gateway.grpc_api import start_grpc

        # the gateway's client as `pdserve gateway` makes it: a bounded pool, its connections named
        client = await connect_redis(self.redis_url, max_connections=self.config.redis_max_connections,
                                     pool_timeout_s=self.config.redis_pool_timeout_s, name="pdserve-gateway")
        router_client = await connect_redis(self.redis_url, max_connections=64, name="fake-router")
        self.core = GatewayCore(client, self.config, self.model, self.keys)
        self.router = FakeRouter(router_client)
        self.server = uvicorn.Server(uvicorn.Config(served_app(self.core), host="127.0.0.1", port=0, lifespan="off",
                                                    log_level="warning", timeout_graceful_shutdown=1))
        grpc_server = None
        router_task = asyncio.create_task(self.router.run())
        try:
            if self.grpc:
                grpc_server, self.grpc_port = await start_grpc(self.core, "127.0.0.1", 0)
            serving = asyncio.create_task(self.server.serve())
            while not self.server.started:
                if serving.done():
                    await serving
                    raise RuntimeError("uvicorn stopped before it started")
                await asyncio.sleep(0.01)
            self.port = self.server.servers[0].sockets[0].getsockname()[1]
            self._ready.set()
            await serving
        finally:
            await self.router.stop()
            await asyncio.wait({router_task}, timeout=2)
            router_task.cancel()
            if grpc_server is not None:
                await grpc_server.stop(grace=None)
            await self.core.close(timeout_s=0.2)
            await client.aclose()
            await router_client.aclose()

    def stop(self) -> None:
        if self._thread.is_alive() and self.port:
            self.loop.call_soon_threadsafe(setattr, self.server, "should_exit", True)
        self._thread.join(15)
        assert not self._thread.is_alive(), "the gateway under test did not stop"


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())
