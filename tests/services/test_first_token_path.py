"""Issue 27's acceptance: a cached prompt's first token, alone and among 16 concurrent streams, takes the
path the design names and no more (docs/structure.md, "A request's round trips").

The stack is ``pdserve up``'s (1 prefill + 1 decode, router, gateway) with the hop probe on
(services/hops.py), and a MONITOR connection on its Redis. Every prompt is sent once to cache it,
then again; of the second sending, per request, from its own timings and commands (no wall-clock
threshold):

* gRPC: the router makes exactly one worker call, Decode on the decode worker that holds the prompt
  (no Prefill, no Reserve, no KV hand-off);
* engine steps: the first token comes from the first step after the engine thread took the request
  in (the newcomer's rest is computed in one step, not split or put off), alone and among 16 streams;
  alone, that is also the first step after the Decode call reached the decode worker (the engine was
  idle). Among 16, the Decode handlers' own turns on the event loop can let a step pass before the
  engine takes one in, so that count is not asserted;
* Redis: the commands naming the request are exactly the design's list, per process; the decode
  worker's are one per chunk event (written in its step's pipeline); and no process sends a SCRIPT
  command (a pipeline's SCRIPT EXISTS would be a round trip that names no request).
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import time

import pytest
import redis

from services import hops
from services.bench.load import OpenAIClient, OpenAIRequest
from services.launcher import LocalStack, StackSpec

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 6
# what one streamed, greedy request asks Redis, by process (docs/structure.md); the decode worker's
# chunk writes are counted apart (one per chunk event)
NAMED = {
    "gateway": collections.Counter({
        "EVALSHA": 2,  # the enqueue script (it claims the coalescing key too); coalescing release at the end
        "HSET": 1, "EXPIRE": 3,  # the request record (with the enqueue, one round trip); attach; detach
        "HINCRBY": 2,  # attach, detach (each with its EXPIRE, one transaction)
        "XRANGE": 1,  # the subscription's catch-up
    }),
    "router": collections.Counter({
        "EXISTS": 1,  # the cancel flag, read beside the dispatch
        "EVALSHA": 2,  # the final event; the ack (finalize script)
    }),
}


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory):
    redis.Redis.from_url(redis_url).flushdb()
    marks = tmp_path_factory.mktemp("hops")
    os.environ[hops.ENV] = str(marks)  # the stack's processes inherit it
    try:
        s = LocalStack(StackSpec(prefill=1, decode=1, redis_url=redis_url, kv_cache_gb=0.25))
        s.start()
    finally:
        os.environ.pop(hops.ENV, None)
    s.marks_dir = str(marks)
    try:
        yield s
    finally:
        s.stop()


class Monitor:
    """Every command Redis runs (MONITOR), kept with the name of the connection that sent it."""

    def __init__(self, url: str):
        self.redis = redis.Redis.from_url(url)
        self.commands: list[tuple[str, list[str]]] = []  # (client address, command words)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Monitor":
        self._thread.start()
        time.sleep(0.3)
        return self

    def _run(self) -> None:
        with self.redis.monitor() as m:
            for cmd in m.listen():
                if cmd.get("client_type") != "lua":  # what a script runs is inside its EVALSHA
                    self.commands.append((f"{cmd['client_address']}:{cmd['client_port']}", cmd["command"].split()))
                if self._stop.is_set():
                    return

    def __exit__(self, *exc) -> None:
        names = {c["addr"]: c["name"] for c in self.redis.client_list()}
        self.roles = {addr: _role(name) for addr, name in names.items()}
        self._stop.set()
        self.redis.ping()  # one more command wakes the listener
        self._thread.join(5)

    def of(self, request_id: str) -> dict[str, collections.Counter]:
        """The commands naming ``request_id``, by the role of the process that sent them."""
        out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for addr, words in self.commands:
            if any(request_id in w for w in words):
                out[self.roles.get(addr, addr)][words[0].upper()] += 1
        return out


def _role(client_name: str) -> str:
    for role in ("gateway", "router", "decode", "prefill"):
        if client_name.startswith(f"pdserve-{role}"):
            return role
    return client_name


def _prompts(tag: str, n: int) -> list[str]:
    words = "river stone light garden window paper engine market silver forest music winter harbor".split()
    # with the chat template, 69 words leave 10 tokens past the last full block (of 16) for streams-1 0, and
    # 0-14 among the 16 (their KV is copied from the block the fresh request left: KVManager._copy_tail)
    return [f"{tag} {i}: " + " ".join(words[(i + k) % len(words)] for k in range(69 + 7 * i)) for i in range(n)]


async def _send_all(stack, texts: list[str]):
    host, port = stack.gateway_address.rsplit(":", 1)
    client = OpenAIClient(host, int(port), MODEL)
    return await asyncio.gather(*(client.send(OpenAIRequest("chat", t, MAX_TOKENS)) for t in texts))


def _check_cached(stack, monitor: Monitor, samples, alone: bool) -> None:
    marks = hops.read(stack.marks_dir)
    chunk_events = {}
    r = redis.Redis.from_url(stack.redis_url)
    for s in samples:
        assert s.ok, s.error
        entries = r.xrange(next(iter(r.scan_iter(f"pd:res:*:{s.request_id}"))))
        chunk_events[s.request_id] = sum(1 for _, f in entries if f[b"type"] == b"chunk")
    # no hidden round trip beside the named commands: every script is loaded, so a pipelined write is its
    # EVALSHAs alone (redis-py's Script objects in a pipeline sent SCRIPT EXISTS first, once per engine step)
    hidden = collections.Counter(monitor.roles.get(a, a) for a, words in monitor.commands if words[0].upper() == "SCRIPT")
    assert not hidden, hidden
    for s in samples:
        m = marks[s.request_id]
        # one gRPC call: Decode on the worker that holds the prompt
        assert "prefill.recv" not in m and "decode.reserve" not in m, sorted(m)
        assert m["decode.recv"]["n"] == 1 and m["router.sent"]["n"] == 1
        # the engine's next step makes the first token (the batch has room for all: max_num_seqs 128)
        assert m["decode.token"]["step"] - m["decode.added"]["step"] == 1, (s.request_id, m)
        if alone:  # the engine was idle: no step ran between the call's arrival and its token's step
            assert m["decode.token"]["step"] - m["decode.recv"]["step"] == 1, (s.request_id, m)
        # Redis: the named commands, and one chunk write per chunk event
        got = monitor.of(s.request_id)
        assert got.get("gateway") == NAMED["gateway"], dict(got)
        router = got.get("router", collections.Counter())
        if not alone and router["EXISTS"] == 0:
            # the cancel flag is read beside the dispatch, and the read is dropped if the dispatch ends first
            # (queue_worker._cancelled_by_flag): with 16 streams at once, one request's read once did not go out
            router = router + collections.Counter({"EXISTS": 1})
        assert router == NAMED["router"], dict(got)
        assert got.get("decode") == collections.Counter({"EVALSHA": chunk_events[s.request_id]}), dict(got)
        assert 1 <= chunk_events[s.request_id] <= MAX_TOKENS
        assert set(got) == {"gateway", "router", "decode"}, dict(got)


@pytest.mark.parametrize("streams", [1, 16])
def test_a_cached_prompt_takes_the_named_path(stack, streams):
    texts = _prompts(f"streams-{streams}", streams)
    asyncio.run(_send_all(stack, texts))  # fresh: computed, and cached on the decode worker
    time.sleep(0.5)  # its KV events reach the router's index
    with Monitor(stack.redis_url) as monitor:
        samples = asyncio.run(_send_all(stack, texts))
        time.sleep(0.5)  # the last detaches and marks are written
    _check_cached(stack, monitor, samples, alone=streams == 1)


def test_a_fresh_prompt_goes_through_the_prefill_worker(stack):
    """The control: the same checks see a hand-off when there is one (so they can fail)."""
    samples = asyncio.run(_send_all(stack, _prompts("fresh", 1)))
    time.sleep(0.5)
    m = hops.read(stack.marks_dir)[samples[0].request_id]
    assert m["prefill.recv"]["n"] == 1 and m["decode.reserve"]["n"] == 1 and m["decode.recv"]["n"] == 1
