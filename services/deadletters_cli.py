"""``pdserve deadletters list|show ID|redrive ID|redrive --all``: inspect and re-drive dead letters.

Thin edge over services.queue.dead_letters: parse, call, print (a table or
``--json``). Errors are raised as ``PdserveError``/``ValueError`` and become a
message and exit status in services.cli.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from services.queue.dead_letters import DeadLetter, DeadLetters
from services.errors import ServiceUnavailableError
from services.registry import redis_client_options

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def add_parser(sub) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--redis-url", default=DEFAULT_REDIS_URL, help=f"the queue's Redis (default {DEFAULT_REDIS_URL})")
    common.add_argument("--json", action="store_true", help="print JSON instead of text")
    p = sub.add_parser("deadletters", help="list, inspect and re-drive requests that failed for good",
                       description="Requests that failed max_deliveries times, or with an error not worth "
                                   "retrying, wait in the dead-letter stream until re-driven.")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = actions.add_parser("list", parents=[common], help="the oldest dead letters")
    ls.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    show = actions.add_parser("show", parents=[common], help="one dead letter in full")
    show.add_argument("id", help="dead-letter id, as `list` prints it")
    redrive = actions.add_parser("redrive", parents=[common], help="queue dead letters again as new requests")
    which = redrive.add_mutually_exclusive_group(required=True)
    which.add_argument("id", nargs="?", help="dead-letter id")
    which.add_argument("--all", action="store_true", help="every dead letter, oldest first")
    for action in (ls, show, redrive):
        action.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    import redis.asyncio as aioredis
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    client = aioredis.Redis.from_url(args.redis_url, **redis_client_options())
    try:
        return await _ACTIONS[args.action](DeadLetters(client), args)
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise ServiceUnavailableError(f"cannot reach Redis at {args.redis_url}: {exc}") from None
    finally:
        await client.aclose()


async def _list(dead: DeadLetters, args) -> int:
    if args.limit < 1:
        raise ValueError("--limit must be >= 1")
    letters, total = await dead.list(args.limit), await dead.count()
    if args.json:
        print(json.dumps({"total": total, "dead_letters": [_summary(d) for d in letters]}))
        return 0
    if not letters:
        print("no dead letters")
        return 0
    print(f"{'ID':<20} {'REQUEST':<28} {'TIER':<12} {'TRIES':>5} {'WORKER':<20} {'DIED':<19} ERROR")
    for d in letters:
        died = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.dead_at))
        print(f"{d.dead_id:<20} {d.request_id[:28]:<28} {d.tier:<12} {d.delivery_count:>5} {d.worker[:20]:<20} "
              f"{died:<19} {_one_line(d.last_error, 60)}")
    if total > len(letters):
        print(f"({len(letters)} of {total} shown; --limit to see more)")
    return 0


async def _show(dead: DeadLetters, args) -> int:
    d = await dead.show(args.id)
    if args.json:
        print(json.dumps(d.to_dict()))
        return 0
    for key, value in _summary(d).items():
        print(f"{key + ':':<16} {value}")
    for key in ("tenant", "model", "sampling", "traceparent", "deadline", "enqueued_at"):
        if key in d.fields:
            print(f"{key + ':':<16} {d.fields[key]}")
    if "token_ids" in d.fields:
        try:
            print(f"{'prompt tokens:':<16} {len(json.loads(d.fields['token_ids']))}")
        except ValueError:
            print(f"{'token_ids:':<16} {_one_line(d.fields['token_ids'], 80)} (not valid JSON)")
    return 0


async def _redrive(dead: DeadLetters, args) -> int:
    if args.all:
        done = []
        try:
            while letters := await dead.list(100):
                for d in letters:
                    done.append({"dead_id": d.dead_id, "request_id": d.request_id,
                                 "entry_id": await dead.redrive(d.dead_id)})
                    if not args.json:
                        print(f"re-drove {d.dead_id} (request {d.request_id}) as entry {done[-1]['entry_id']}")
        finally:
            if args.json:
                print(json.dumps({"redriven": done}))
        if not done and not args.json:
            print("no dead letters")
        return 0
    d = await dead.show(args.id)
    entry_id = await dead.redrive(args.id)
    if args.json:
        print(json.dumps({"redriven": [{"dead_id": d.dead_id, "request_id": d.request_id, "entry_id": entry_id}]}))
    else:
        print(f"re-drove {d.dead_id} (request {d.request_id}) as entry {entry_id} on tier {d.tier}")
    return 0


def _summary(d: DeadLetter) -> dict:
    return {"id": d.dead_id, "request_id": d.request_id, "tier": d.tier, "delivery_count": d.delivery_count,
            "worker": d.worker, "error_code": d.error_code, "last_error": d.last_error, "entry_id": d.entry_id,
            "dead_at": d.dead_at}


def _one_line(s: str, width: int) -> str:
    s = " ".join(s.split())
    return s if len(s) <= width else s[:width - 1] + "…"


_ACTIONS = {"list": _list, "show": _show, "redrive": _redrive}
