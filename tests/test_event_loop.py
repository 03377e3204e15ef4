"""The gateway's event loop choice and its garbage-collector settling (services/event_loop.py)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from services import event_loop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_auto_runs_on_uvloop_when_installed_and_asyncio_on_the_stdlib_loop():
    pytest.importorskip("uvloop")  # a declared dependency on Linux
    assert event_loop.run(_loop_module(), "auto").startswith("uvloop")
    assert event_loop.run(_loop_module(), "uvloop").startswith("uvloop")
    assert event_loop.run(_loop_module(), "asyncio").startswith("asyncio")


def test_an_unknown_loop_is_refused_by_name():
    coro = _loop_module()
    with pytest.raises(ValueError, match="loop must be one of auto, uvloop, asyncio"):
        event_loop.run(coro, "tokio")
    coro.close()


def test_settle_gc_exempts_what_exists_from_later_collections():
    kept = [[i] for i in range(1000)]  # tracked objects made "at startup"
    try:
        event_loop.settle_gc()
        assert gc.get_freeze_count() >= len(kept)
        assert not any(obj is kept for obj in gc.get_objects())  # frozen: out of every generation
    finally:
        gc.unfreeze()


def test_settle_gc_sets_the_thresholds_it_is_given():
    before = gc.get_threshold()
    try:
        event_loop.settle_gc((700, 10, 100))
        assert gc.get_threshold() == (700, 10, 100)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_gc_thresholds_are_three_whole_numbers_and_anything_else_is_refused_by_the_gateway():
    import subprocess
    import sys

    assert event_loop.parse_gc_thresholds("700,10,100") == (700, 10, 100)
    for bad in ("700,10", "700,10,0", "a,b,c", "700,10,-1", ""):
        with pytest.raises(ValueError, match="three whole numbers >= 1"):
            event_loop.parse_gc_thresholds(bad)
    out = subprocess.run([sys.executable, "-m", "services.cli", "gateway", "--gc-thresholds", "700,10"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--gc-thresholds" in out.stderr


def test_workers_take_the_loop_flag_and_refuse_an_unknown_one():
    import subprocess
    import sys

    from services.cli import build_parser

    args = build_parser().parse_args(["decode"])
    assert args.loop == "auto"  # uvloop when installed: the engine's cores pay for the loop's CPU
    assert build_parser().parse_args(["prefill", "--loop", "asyncio"]).loop == "asyncio"
    bad = subprocess.run([sys.executable, "-m", "services.cli", "decode", "--loop", "tokio"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'tokio'" in bad.stderr
