"""``pdserve client``: a small gRPC client of the public Generation API (streams text to stdout).

    pdserve client --prompt "What is the capital of France?"          # chat template applied
    pdserve client --raw --prompt "Once upon a time" --max-tokens 32
    python -m services.client --address 127.0.0.1:50051 --prompt "..."
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import grpc

from proto.pdserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc


def build_request(args) -> generate_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.seed is not None:
        sampling.seed = args.seed
    req = generate_pb2.GenerateRequest(sampling=sampling, request_id=args.request_id or "")
    if args.raw:
        req.text = args.prompt
    else:
        req.chat.messages.append(generate_pb2.ChatMessage(role="user", content=args.prompt))
    return req


async def generate(args) -> int:
    async with grpc.aio.insecure_channel(args.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        try:
            async for msg in stub.Generate(build_request(args), timeout=args.timeout):
                if msg.HasField("chunk"):
                    if not args.json:
                        sys.stdout.write(msg.chunk.text)
                        sys.stdout.flush()
                else:
                    f = msg.finish
                    summary = {"request_id": msg.request_id, "finish_reason": f.finish_reason,
                               "prompt_tokens": f.usage.prompt_tokens,
                               "completion_tokens": f.usage.completion_tokens,
                               "cached_prompt_tokens": f.usage.cached_prompt_tokens,
                               "ttft_ms": round(f.timings.ttft_ms, 1), "e2e_ms": round(f.timings.e2e_ms, 1),
                               "prefill_worker": f.prefill_worker, "decode_worker": f.decode_worker}
                    print(json.dumps(summary) if args.json else "\n" + json.dumps(summary), file=sys.stdout)
        except grpc.aio.AioRpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2 if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="127.0.0.1:50051", help="the router's (or gateway's) gRPC address")
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="send the prompt as raw text (no chat template)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--request-id", default=None)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the call is abandoned")
    p.add_argument("--json", action="store_true", help="print only the final summary as JSON")


def run(args) -> int:
    return asyncio.run(generate(args))


def add_parser(sub) -> None:
    p = sub.add_parser("client", help="send one prompt to a running stack over gRPC and stream the answer")
    add_arguments(p)
    p.set_defaults(func=run)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m services.client", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
