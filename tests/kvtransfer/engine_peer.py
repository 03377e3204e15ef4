"""A child process holding a real engine on one side of the hand-off, driven by JSON lines.

    python -m tests.kvtransfer.engine_peer decode|prefill ucx|ucx-put|tcp DTYPE [KV_CACHE_DTYPE]

Decode: prints {"address": ...}; "reserve" answers with the descriptor, and later
with the decoded tokens (or the transfer error). Prefill: "prefill" runs
prefill-only and writes the KV into the descriptor's blocks as chunks finish.
Both answer "stats" with the blocks still in use (the leak check).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading

from kvtransfer import Receiver, Sender, TransferConfig, TransferDescriptor
from services.config import EngineConfig
from services.engine.async_engine import AsyncEngine
from services.engine.engine import Engine
from services.handoff import EngineBlockOwner, decode_after_transfer, prefill_and_send, reserve_for_transfer
from services.engine.sampling_params import SamplingParams


def reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def main(role: str, transport: str, dtype: str, kv_cache_dtype: str = "auto") -> None:
    engine = Engine(EngineConfig(dtype=dtype, long_prefill_chunk=64, max_num_batched_tokens=128,
                                 kv_cache_dtype=kv_cache_dtype))
    aengine = AsyncEngine(engine)
    # ucx-put: every payload split between the receiver's pull and the sender's put
    # (by default only messages of 4 MiB and more are; the test prompts' are smaller).
    if transport == "ucx-put":
        config = TransferConfig(transport="ucx", op_timeout_s=20, ucx_put_min_bytes=1)
    else:
        config = TransferConfig(transport=transport, op_timeout_s=20)
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue = asyncio.Queue()
    threading.Thread(target=lambda: [loop.call_soon_threadsafe(lines.put_nowait, l) for l in sys.stdin],
                     daemon=True).start()
    if role == "decode":
        owner = EngineBlockOwner(aengine)
        receiver = Receiver(engine.kv_cache, engine.namespace, owner, config)
        await receiver.start()
        reply({"address": receiver.address})
    else:
        sender = Sender(engine.kv_cache, engine.namespace, config)
        reply({"ready": True})

    async def decode(cmd: dict) -> None:
        rid, params = cmd["rid"], SamplingParams(max_tokens=cmd["max_tokens"], temperature=0)
        try:
            pending = await reserve_for_transfer(aengine, owner, receiver, rid, cmd["prompt"], params,
                                                 cmd.get("timeout_s", 60))
        except Exception as exc:
            return reply({"rid": rid, "error": f"{type(exc).__name__}: {exc}"})
        reply({"rid": rid, "descriptor": pending.descriptor.to_bytes().hex()})
        try:
            completion = await pending
            tokens = [t async for out in decode_after_transfer(aengine, rid, completion) for t in out.new_token_ids]
            reply({"rid": rid, "tokens": tokens, "nbytes": completion.nbytes})
        except Exception as exc:
            reply({"rid": rid, "error": f"{type(exc).__name__}: {exc}"})

    async def prefill(cmd: dict) -> None:
        rid = cmd["rid"]
        desc = TransferDescriptor.from_bytes(bytes.fromhex(cmd["descriptor"]))
        try:
            result = await prefill_and_send(aengine, sender, desc, cmd["prompt"],
                                            SamplingParams(max_tokens=cmd["max_tokens"], temperature=0))
            reply({"rid": rid, "first_token": result.first_token})
        except Exception as exc:
            reply({"rid": rid, "error": f"{type(exc).__name__}: {exc}"})

    async def local(cmd: dict) -> None:  # the single-engine reference run
        params = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0)
        tokens = [t async for out in aengine.generate(cmd["prompt"], params, request_id=cmd["rid"])
                  for t in out.new_token_ids]
        reply({"rid": cmd["rid"], "tokens": tokens})

    tasks = set()
    while True:
        line = await lines.get()
        cmd = json.loads(line)
        if cmd["op"] == "stats":
            used = await aengine.call(lambda: engine.block_pool.num_used)
            reply({"op": "stats", "used_blocks": used, "requests": len(engine.requests)})
            continue
        if cmd["op"] == "quit":
            break
        handler = {"reserve": decode, "prefill": prefill, "local": local}[cmd["op"]]
        task = asyncio.create_task(handler(cmd))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    aengine.shutdown()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
