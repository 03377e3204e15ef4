"""The checks of scripts/compose-smoke.sh against a running compose stack (the script brings it up and down).

1. the gateway is ready; one streaming chat completion through it with the official openai client;
2. decode scaled to 2 (`up --scale decode=2`): both register themselves with their container address;
3. while STREAMS requests stream, the decode container running most of them is SIGKILLed (a crash, not a stop):
   every request must still end, with its tokens or a clear error; none may hang or vanish;
4. the killed container comes back (restart: unless-stopped) and registers again.

Exit status 0 only if all of that held. Usage: python scripts/compose_smoke.py COMPOSE_ARGS...
(the docker-compose arguments naming the project, e.g. "-p pdserve-smoke").
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

STREAMS = 6
MODEL = "SmolLM2-135M-Instruct"


def log(message: str) -> None:
    print(f"[smoke] {message}", flush=True)


class Compose:
    def __init__(self, args: list[str]):
        self.args = args

    def __call__(self, *argv: str, check: bool = True) -> str:
        result = subprocess.run(["docker-compose", *self.args, *argv], capture_output=True, text=True)
        if check and result.returncode != 0:
            raise RuntimeError(f"docker-compose {' '.join(argv)} failed:\n{result.stderr}")
        return result.stdout

    def containers(self, service: str) -> list[str]:
        return self("ps", "-q", service).split()

    def gateway_url(self) -> str:
        host_port = self("port", "gateway", "8000").strip()  # e.g. 0.0.0.0:49153
        return f"http://127.0.0.1:{host_port.rsplit(':', 1)[1]}"


def ready(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(f"{url}/health/ready", timeout=5) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def wait_for(what: str, check, timeout_s: float, every_s: float = 2.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    raise TimeoutError(f"{what}: not after {timeout_s:.0f} s")


_RUNNING = ("import urllib.request; print(sum(float(l.split()[-1]) for l in urllib.request.urlopen("
            "'http://127.0.0.1:9400/metrics').read().decode().splitlines() if l.startswith('pdserve_num_running')))")


def busiest(containers: list[str]) -> tuple[str, float] | None:
    """The decode container running the most requests (from its own /metrics), once one runs any."""
    counts = []
    for c in containers:
        out = subprocess.run(["docker", "exec", c, "python", "-c", _RUNNING], capture_output=True, text=True)
        counts.append((float(out.stdout.strip() or 0), c))
    running, container = max(counts)
    return (container, running) if running >= 1 else None


def chat(client, prompt: str, max_tokens: int, ignore_eos: bool = False) -> tuple[str, str]:
    """(text, finish_reason) of one streamed chat completion."""
    text, finish = [], None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, temperature=0, max_tokens=max_tokens,
                                                messages=[{"role": "user", "content": prompt}],
                                                extra_body={"ignore_eos": ignore_eos}):
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish


def main(compose_args: list[str]) -> int:
    from openai import APIError, OpenAI

    compose = Compose(compose_args)
    url = compose.gateway_url()
    state = wait_for("the gateway ready (a decode worker registered)", lambda: ready(url), 600)
    log(f"gateway {url} ready: {state}")
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    text, finish = chat(client, "What is the capital of France?", 32)
    log(f"streamed chat completion ({finish}): {text!r}")
    if not text or finish not in ("stop", "length"):
        log("FAIL: the first request got no text")
        return 1

    compose("up", "-d", "--no-recreate", "--scale", "decode=2", "decode")
    wait_for("two decode workers registered", lambda: (ready(url) or {}).get("decode_workers", 0) >= 2, 600)
    decoders = compose.containers("decode")
    log(f"decode scaled to {len(decoders)}: {', '.join(c[:12] for c in decoders)}")

    results: list[tuple[str, str]] = [("", "")] * STREAMS

    def run(i: int) -> None:
        try:
            # long and EOS-proof, so the streams are still running when the poll below looks: with the
            # GGUF default, 96 tokens ended within one 2 s poll and the smoke missed them
            text, finish = chat(client, f"Write a short story about a robot, number {i}.", 512, ignore_eos=True)
            results[i] = ("tokens", f"{finish}: {text[:40]!r}" if text else "no text")
        except APIError as exc:
            results[i] = ("error", f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a transport failure is a result too; it must be clear
            results[i] = ("error", f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(STREAMS)]
    for t in threads:
        t.start()
    victim, running = wait_for("a decode worker running the requests", lambda: busiest(decoders), 120, every_s=0.2)
    pid = subprocess.run(["docker", "inspect", "-f", "{{.State.Pid}}", victim], capture_output=True, text=True,
                         check=True).stdout.strip()
    # SIGKILL the container's init from the host: the container dies as in a crash (an OOM kill), which
    # the restart policy answers; `docker kill` would count as an operator's stop
    subprocess.run(["kill", "-9", pid], check=True)
    log(f"SIGKILLed decode container {victim[:12]} (pid {pid}) while it ran {running:.0f} of the {STREAMS} "
        "streaming requests")
    for t in threads:
        t.join(300)
    hung = [i for i, t in enumerate(threads) if t.is_alive()]
    for i, (kind, detail) in enumerate(results):
        log(f"request {i}: {kind or 'HUNG'} {detail}")
    lost = [i for i, (kind, detail) in enumerate(results) if kind == "tokens" and detail == "no text"]
    unclear = [i for i, (kind, detail) in enumerate(results) if kind == "error" and len(detail) < 20]
    if hung or lost or unclear:
        log(f"FAIL: hung {hung}, ended without text {lost}, unclear errors {unclear}")
        return 1
    ok = sum(1 for kind, _ in results if kind == "tokens")
    log(f"every request ended: {ok} with tokens, {STREAMS - ok} with a clear error")

    def restarted() -> bool:
        info = json.loads(subprocess.run(["docker", "inspect", victim], capture_output=True, text=True).stdout)[0]
        return info["RestartCount"] >= 1 and info["State"]["Running"]

    wait_for("the killed decode container restarted", restarted, 120)
    wait_for("two decode workers registered again", lambda: (ready(url) or {}).get("decode_workers", 0) >= 2, 600)
    text, finish = chat(client, "Name a colour.", 8)
    log(f"after the restart ({finish}): {text!r}")
    return 0 if text else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
