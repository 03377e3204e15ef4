"""The ``pdserve`` command: one subcommand per service or tool; errors become a message and exit status."""

from __future__ import annotations

import argparse
import sys

from services import env_defaults, generate
from services.errors import PdserveError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate.add_parser(sub)
    from services import client, deadletters_cli, probe, up
    from services.decode import server as decode_server
    from services.gateway import server as gateway_server
    from services.prefill import server as prefill_server
    from services.router import server as router_server

    up.add_parser(sub)
    prefill_server.add_parser(sub)
    decode_server.add_parser(sub)
    router_server.add_parser(sub)
    gateway_server.add_parser(sub)
    client.add_parser(sub)
    deadletters_cli.add_parser(sub)
    probe.add_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks that run pdserve and a baseline side by side")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    from kvtransfer import bench as kvtransfer_bench
    from services.bench import loadtools as loadtools_bench
    from services.engine import bench as engine_bench
    from services.engine import gpu_bench
    from services.gateway import bench as serve_bench
    from services.gateway import frontdoor_bench
    from services.router import bench as routing_bench

    engine_bench.add_parser(bench_sub)
    kvtransfer_bench.add_parser(bench_sub)
    gpu_bench.add_parser(bench_sub)
    routing_bench.add_parser(bench_sub)
    from services.bench import results as result_files

    serve_bench.add_parser(bench_sub)
    loadtools_bench.add_parser(bench_sub)
    frontdoor_bench.add_parser(bench_sub)
    for bench_parser in bench_sub.choices.values():
        result_files.add_save_argument(bench_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["probe"]:
        # Health checks run every few seconds in every container: skip the full parser, which
        # imports the servers and torch (seconds of CPU each time).
        from services import probe

        return probe.main(argv[1:])
    parser = build_parser()
    env_defaults.apply(parser)  # PDSERVE_<FLAG> variables are the flags' defaults
    args = parser.parse_args(argv)
    env_defaults.check(parser, args)
    try:
        return args.func(args)
    except PdserveError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2 if exc.http_status < 500 else 1
    except ValueError as exc:  # invalid configuration
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
