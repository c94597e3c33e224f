#!/usr/bin/env python3
"""Soak test (not in CI): many concurrent streams for minutes while workers
are killed with SIGKILL at a fixed period. Every stream is compared with its
no-fault output, so a token lost, repeated or wrong anywhere is counted.

It starts one coordinator with --local-workers N (the coordinator restarts a
killed worker) on a model from tests/models, measures each case's
reference output before any fault, then runs CONCURRENCY clients, each
streaming /generate requests back to back, and kills one worker every
--kill-every seconds. Cases mix greedy, seeded sampling and penalties, all of
which must continue exactly after a re-dispatch.

At the end it prints, and writes as JSON with --json: streams completed and
failed, tokens lost / repeated / wrong, the coordinator's peak and
first/last-minute RSS and open file descriptors, and kills done.

Standard library only. Example (the figures in RELIABILITY.md):
    cargo build --release --bins
    python3 tools/soak.py --duration 600 --concurrency 1000 --kill-every 60
"""

import argparse
import asyncio
import difflib
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROMPTS = [
    "Once upon a time, there was a little girl named Lily.",
    "The cat sat on the mat and looked at the",
    "Tom and his dog went to the park. They",
    "One day, a big bird flew over the house and",
    "Sue had a red ball. She liked to",
    "The sun was hot, so the children went to the",
]

MODES = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.8, "top_p": 0.95, "seed": 1234},
    "penalties": {
        "temperature": 0.0,
        "frequency_penalty": 0.6,
        "presence_penalty": 0.4,
        "repetition_penalty": 1.15,
    },
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def post(port: int, body: dict, stream: bool):
    """POST /generate; returns (token_ids, error or None)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        data = json.dumps(body).encode()
        writer.write(
            b"POST /generate HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        await writer.drain()
        status_line = await reader.readline()
        parts = status_line.split()
        status = int(parts[1]) if len(parts) > 1 else 0
        headers = {}
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        payload = await read_body(reader, headers)
        if status != 200:
            return [], f"HTTP {status}: {payload[:200]!r}"
        if not stream:
            return json.loads(payload)["token_ids"], None
        tokens, done = [], False
        for event in payload.decode().split("\n\n"):
            event = event.strip()
            if not event.startswith("data:"):
                continue
            text = event[len("data:") :].strip()
            if text == "[DONE]":
                continue
            msg = json.loads(text)
            if "error" in msg:
                return tokens, f"stream error: {msg['error']}"
            tokens.extend(msg.get("token_ids", []))
            if msg.get("finish_reason"):
                done = True
        return tokens, None if done else "stream ended without a finish_reason"
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        return [], f"{type(e).__name__}: {e}"
    finally:
        writer.close()


async def read_body(reader, headers) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out = bytearray()
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return bytes(out)
            out += await reader.readexactly(size)
            await reader.readline()
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    return await reader.read()


def compare(reference: list, got: list) -> tuple:
    """(lost, repeated, wrong) tokens of `got` against `reference`."""
    lost = repeated = wrong = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=reference, b=got, autojunk=False).get_opcodes():
        if op == "delete":
            lost += i2 - i1
        elif op == "insert":
            repeated += j2 - j1
        elif op == "replace":
            wrong += max(i2 - i1, j2 - j1)
    return lost, repeated, wrong


def proc_stats(pid: int) -> tuple:
    """(RSS in MiB, open file descriptors) of a process, or (0, 0) once gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return 0.0, 0


def worker_pids(coordinator_pid: int) -> list:
    out = subprocess.run(["pgrep", "-P", str(coordinator_pid), "-f", "tinyvllm-worker"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


async def get_json(port: int, path: str) -> dict:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        await reader.readline()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        return json.loads(await read_body(reader, headers))
    finally:
        writer.close()


async def wait_ready(port: int, workers: int, timeout: float):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            health = await get_json(port, "/health")
            if health.get("status") == "ok" and health.get("workers", 0) >= workers:
                return
        except (OSError, ValueError):
            pass
        await asyncio.sleep(0.5)
    raise SystemExit(f"the cluster did not become ready in {timeout:.0f} s")


async def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "tests/models/stories260K"))
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--duration", type=float, default=600)
    ap.add_argument("--concurrency", type=int, default=1000)
    ap.add_argument("--kill-every", type=float, default=60)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--bin-dir", default=str(REPO / "target/release"))
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args()

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    port, quic = free_port(), free_port()
    log = open(REPO / "target/soak-coordinator.log", "w")
    coordinator = subprocess.Popen(
        [
            f"{args.bin_dir}/tinyvllm-coordinator",
            "--model", args.model,
            "--http", f"127.0.0.1:{port}",
            "--quic", f"127.0.0.1:{quic}",
            "--local-workers", str(args.workers),
            "--cluster-secret-file", str(REPO / "target/soak-secret"),
            "--max-queued-requests", str(args.concurrency * 2),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        await wait_ready(port, args.workers, 120)
        cases = [(p, m) for p in PROMPTS for m in MODES]
        reference = {}
        for prompt, mode in cases:
            body = {"prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True, **MODES[mode]}
            tokens, err = await post(port, body, stream=False)
            if err:
                raise SystemExit(f"reference for {mode!r} failed: {err}")
            reference[(prompt, mode)] = tokens

        totals = {"streams_ok": 0, "streams_failed": 0, "lost": 0, "repeated": 0, "wrong": 0, "kills": 0}
        failures = []
        deadline = time.time() + args.duration

        async def client(i: int):
            rng = random.Random(i)
            while time.time() < deadline:
                prompt, mode = rng.choice(cases)
                body = {
                    "prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True,
                    **MODES[mode],
                }
                tokens, err = await post(port, body, stream=True)
                lost, repeated, wrong = compare(reference[(prompt, mode)], tokens)
                if err:
                    totals["streams_failed"] += 1
                    if len(failures) < 20:
                        failures.append(err)
                else:
                    totals["streams_ok"] += 1
                    totals["lost"] += lost
                    totals["repeated"] += repeated
                    totals["wrong"] += wrong

        samples = []

        async def monitor():
            next_kill = time.time() + args.kill_every
            while time.time() < deadline:
                samples.append((time.time(), *proc_stats(coordinator.pid)))
                if time.time() >= next_kill:
                    pids = worker_pids(coordinator.pid)
                    if pids:
                        os.kill(random.choice(pids), signal.SIGKILL)
                        totals["kills"] += 1
                    next_kill += args.kill_every
                await asyncio.sleep(2)

        started = time.time()
        await asyncio.gather(monitor(), *(client(i) for i in range(args.concurrency)))
        elapsed = time.time() - started
        minute = 60
        first = [r for t, r, _ in samples if t - started < minute]
        last = [r for t, r, _ in samples if started + elapsed - t < minute]
        report = {
            **totals,
            "seconds": round(elapsed, 1),
            "concurrency": args.concurrency,
            "workers": args.workers,
            "coordinator_rss_peak_mib": round(max(r for _, r, _ in samples), 1),
            "coordinator_rss_first_minute_mib": round(max(first), 1) if first else None,
            "coordinator_rss_last_minute_mib": round(max(last), 1) if last else None,
            "coordinator_fds_peak": max(f for _, _, f in samples),
            "coordinator_fds_end": proc_stats(coordinator.pid)[1],
            "redispatches": (await get_json(port, "/v1/workers")).get("redispatches"),
            "failures": failures,
        }
        print(json.dumps(report, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
        bad = report["lost"] + report["repeated"] + report["wrong"] + report["streams_failed"]
        return 1 if bad else 0
    finally:
        coordinator.send_signal(signal.SIGTERM)
        try:
            coordinator.wait(timeout=40)
        except subprocess.TimeoutExpired:
            coordinator.kill()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
