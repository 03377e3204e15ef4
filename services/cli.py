"""The ``pdserve`` command: one subcommand per service or tool; errors become a message and exit status."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from services import env_defaults, openmp_env
from services.errors import is_described

# command -> the module whose add_parser(sub) defines it. A command's module is imported only when
# that command runs (or when the full help is asked for): `pdserve router` and `pdserve gateway`
# must not import the workers' modules, which pull in torch, the kernels and kvtransfer.
COMMANDS = {
    "generate": "services.generate",
    "up": "services.up",
    "prefill": "services.prefill.server",
    "decode": "services.decode.server",
    "router": "services.router.server",
    "gateway": "services.gateway.server",
    "client": "services.client",
    "deadletters": "services.deadletters_cli",
    "probe": "services.probe",
    "planner": "services.planner.cli",
    "profile": "services.profiling.cli",
    "bench": None,  # add_bench_parser below
}
BENCHES = {
    "engine": "services.engine.bench",
    "kvtransfer": "services.bench.transfer",
    "gpu": "services.engine.gpu_bench",
    "spec": "services.engine.spec_bench",
    "structured": "services.engine.structured_bench",
    "lora": "services.engine.lora_bench",
    "routing": "services.router.bench",
    "serve": "services.gateway.bench",
    "coalesce": "services.gateway.coalesce_bench",
    "loadtools": "services.bench.loadtools",
    "peer": "services.bench.peer",
    "frontdoor": "services.gateway.frontdoor_bench",
    "startup": "services.bench.startup",
    "chaos": "services.bench.chaos",
    "soak": "services.bench.soak",
    "sim": "services.sim.bench",
    "cascade": "services.sim.cascade",
    "breakdown": "services.bench.breakdown",
    "kvtier": "services.bench.kvtier",
    "profiling": "services.profiling.bench",
    "hops": "services.bench.hops",
}


def add_bench_parser(sub) -> None:
    """``pdserve bench BENCH``; every bench takes --save."""
    from services.bench import results as result_files

    bench = sub.add_parser("bench", help="benchmarks that run pdserve and a baseline side by side")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for module in BENCHES.values():
        importlib.import_module(module).add_parser(bench_sub)
    for bench_parser in bench_sub.choices.values():
        result_files.add_save_argument(bench_parser)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for ``argv``: only the named command's module is imported (all of them without one)."""
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    command = next((a for a in argv or () if not a.startswith("-")), None)
    for name, module in COMMANDS.items():
        if command in (None, name) or command not in COMMANDS:
            (importlib.import_module(module).add_parser if module else add_bench_parser)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["probe"]:
        # Health checks run every few seconds in every container: skip argparse's set-up entirely.
        from services import probe

        return probe.main(argv[1:])
    openmp_env.apply()  # before build_parser imports torch, which loads libgomp
    parser = build_parser(argv)
    env_defaults.apply(parser)  # PDSERVE_<FLAG> variables are the flags' defaults
    args = parser.parse_args(argv)
    env_defaults.check(parser, args)
    if args.command == "bench":  # a bench stopped by SIGTERM (timeout(1)) stops the stack it started: its
        # context managers run, where the default action left every worker running on the cores later runs use
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if is_described(exc):  # a pdserve error, or kvtransfer's TransferError
            print(f"error: {exc.message}", file=sys.stderr)
            return 2 if exc.http_status < 500 else 1
        if isinstance(exc, ValueError):  # invalid configuration
            print(f"error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
