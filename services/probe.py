"""``pdserve probe``: health checks for container engines (exit 0 healthy, 1 not, 2 bad use).

    pdserve probe grpc HOST:PORT [--service NAME]   grpc.health.v1 Check: SERVING?
    pdserve probe http URL                          GET: a 2xx answer?
    pdserve probe self                              the pdserve server this container runs

``self`` is the image's HEALTHCHECK: one image serves every role, so it reads the
command of the container's pdserve process (PID 1, or PID 1's child under an init)
and checks that role's real health endpoint: ``/health/ready`` for the gateway,
the gRPC health service of the router and the workers (SERVING once the model
is loaded and the worker registered). The port comes from the command's
``--port``, else ``PDSERVE_PORT``, else the role's default.

Container engines run this every few seconds in every container, so it imports
neither torch nor the servers: ``services.cli`` hands ``probe`` straight here.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from services.advertise import WILDCARDS, host_port

ROLES = ("prefill", "decode", "router", "gateway")
DEFAULT_PORTS = {"router": 50051, "gateway": 8000}


def probe_grpc(address: str, service: str = "", timeout_s: float = 3.0) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                               timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, f"{address}: {exc.code().name} {exc.details() or ''}".strip()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {status}"


def probe_http(url: str, timeout_s: float = 3.0) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return 200 <= resp.status < 300, f"{url}: {resp.status}"
    except urllib.error.HTTPError as exc:
        return False, f"{url}: {exc.code} {exc.read(200).decode(errors='replace').strip()}"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"{url}: {getattr(exc, 'reason', exc)}"


def server_command(proc: Path = Path("/proc")) -> list[str]:
    """The argv of this container's pdserve server: PID 1, or a child of PID 1 (under tini/docker-init)."""
    for pid in ["1"] + [p.name for p in proc.iterdir() if p.name.isdigit() and _parent(proc / p.name) == "1"]:
        try:
            argv = [a.decode(errors="replace") for a in (proc / pid / "cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        if _role_index(argv) is not None:
            return argv
    raise LookupError("no pdserve server (pdserve prefill|decode|router|gateway) is PID 1 or its child here; "
                      "`probe self` is for containers")


def _parent(pid_dir: Path) -> str | None:
    try:
        for line in (pid_dir / "status").read_text().splitlines():
            if line.startswith("PPid:"):
                return line.split()[1]
    except OSError:
        pass
    return None


def _role_index(argv: list[str]) -> int | None:
    for i, arg in enumerate(argv[:-1]):
        if arg.endswith("pdserve") or arg == "services.cli":
            return i + 1 if argv[i + 1] in ROLES else None
    return None


def self_target(argv: list[str], environ=os.environ) -> tuple[str, str]:
    """(kind, target) to probe for a server's argv: ("http", url) or ("grpc", host:port)."""
    role = argv[_role_index(argv)]
    flags = _flags(argv)
    port = flags.get("--port") or environ.get("PDSERVE_PORT") or DEFAULT_PORTS.get(role)
    if port is None or int(port) == 0:
        raise LookupError(f"the {role} listens on a random port; give it --port (or PDSERVE_PORT)")
    host = flags.get("--host") or environ.get("PDSERVE_HOST") or "127.0.0.1"
    host = "127.0.0.1" if host in WILDCARDS else host
    if role == "gateway":
        return "http", f"http://{host_port(host, int(port))}/health/ready"
    return "grpc", host_port(host, int(port))


def _flags(argv: list[str]) -> dict[str, str]:
    flags = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--") and "=" in arg:
            key, value = arg.split("=", 1)
            flags[key] = value
        elif arg.startswith("--") and i + 1 < len(argv):
            flags[arg] = argv[i + 1]
    return flags


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve probe", description="Health checks (exit 0: healthy, 1: not).")
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer")
    common.add_argument("--quiet", action="store_true", help="print nothing, only set the exit status")
    sub = p.add_subparsers(dest="kind", required=True, metavar="KIND")
    g = sub.add_parser("grpc", parents=[common], help="grpc.health.v1 Check of HOST:PORT")
    g.add_argument("address", metavar="HOST:PORT")
    g.add_argument("--service", default="", help="the service name to ask about (default: the server as a whole)")
    h = sub.add_parser("http", parents=[common], help="GET URL, healthy on a 2xx answer")
    h.add_argument("url")
    sub.add_parser("self", parents=[common],
                   help="the pdserve server running in this container (the image's HEALTHCHECK)")


def run(args) -> int:
    try:
        kind, target, service = args.kind, getattr(args, "address", None) or getattr(args, "url", None), \
            getattr(args, "service", "")
        if kind == "self":
            kind, target = self_target(server_command())
        ok, detail = probe_grpc(target, service, args.timeout) if kind == "grpc" else probe_http(target, args.timeout)
    except (LookupError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"{'healthy' if ok else 'unhealthy'}: {detail}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    return run(build_parser().parse_args(argv))


def add_parser(sub) -> None:
    p = sub.add_parser("probe", help="health checks for containers: grpc HOST:PORT, http URL, self",
                       description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=run)
