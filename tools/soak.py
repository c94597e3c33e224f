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

With --faults, the workers are remote instead (started by this script,
restarted 2 s after a kill), each reaching the coordinator only through its
own impaired link (tinyvllm-netem: 2% loss, 5 +/- 2 ms each way); every
--flap-every seconds one link is cut for --flap-for seconds (longer than
the coordinator's 3 s liveness bound, so the worker is failed over and
comes back), and every --kill-every seconds one worker is killed. The
defaults then are the issue 58 profile: 30 minutes, 200 streams, a flap
every 2 minutes, a kill every 5.

Standard library only. Examples (the figures in RELIABILITY.md):
    cargo build --release --bins
    python3 tools/soak.py --duration 600 --concurrency 1000 --kill-every 60
    python3 tools/soak.py --faults
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


class RemoteWorkers:
    """--faults: workers started here, each behind its own tinyvllm-netem."""

    def __init__(self, args, quic: int):
        self.args = args
        self.quic = quic
        self.links = []
        self.workers = [None] * args.workers
        self.restart_at = [None] * args.workers
        self.restore_at = {}
        self.log = open(REPO / "target/soak-workers.log", "w")
        self.netem_log = open(REPO / "target/soak-netem.log", "w")
        for i in range(args.workers):
            link = subprocess.Popen(
                [f"{args.bin_dir}/tinyvllm-netem", "--listen", "127.0.0.1:0", "--target", f"127.0.0.1:{quic}",
                 "--seed", str(args.seed + i), "delay_ms=5", "jitter_ms=2", f"loss={args.loss}"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.netem_log, text=True,
            )
            first = link.stdout.readline()
            address = first.strip().split("listening=")[1]
            self.links.append((link, address))

    def start(self, i: int):
        _, address = self.links[i]
        self.workers[i] = subprocess.Popen(
            [f"{self.args.bin_dir}/tinyvllm-worker", "serve", "--model", self.args.model, "--coordinator", address,
             "--name", f"remote-{i}", "--cluster-secret-file", str(REPO / "target/soak-secret"),
             "--state-dir", str(REPO / f"target/soak-state-{i}")],
            stdout=self.log, stderr=subprocess.STDOUT,
        )

    def start_all(self):
        for i in range(len(self.workers)):
            self.start(i)

    def kill(self, i: int):
        self.workers[i].kill()
        self.workers[i].wait()
        self.restart_at[i] = time.time() + 2

    def command(self, i: int, line: str):
        link, _ = self.links[i]
        link.stdin.write(line + "\n")
        link.stdin.flush()

    def flap(self, i: int, seconds: float):
        self.command(i, "cut")
        self.restore_at[i] = time.time() + seconds

    def tend(self):
        now = time.time()
        for i, at in list(self.restore_at.items()):
            if now >= at:
                self.command(i, "restore")
                del self.restore_at[i]
        for i, at in enumerate(self.restart_at):
            if at is not None and now >= at:
                self.start(i)
                self.restart_at[i] = None

    def describe(self) -> dict:
        return {"links": f"{self.args.loss:.0%} loss, 5 +/- 2 ms each way", "flap_every": self.args.flap_every,
                "flap_for": self.args.flap_for, "kill_every": self.args.kill_every}

    def stop(self):
        for w in self.workers:
            if w and w.poll() is None:
                w.terminate()
        for link, _ in self.links:
            link.kill()


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
    ap.add_argument("--faults", action="store_true", help="remote workers behind impaired links (see above)")
    ap.add_argument("--flap-every", type=float, default=120)
    ap.add_argument("--flap-for", type=float, default=5)
    ap.add_argument("--loss", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=58)
    args = ap.parse_args()
    if args.faults:
        # The issue 58 profile, unless given.
        given = set(a.split("=")[0] for a in sys.argv[1:])
        if "--duration" not in given:
            args.duration = 1800
        if "--concurrency" not in given:
            args.concurrency = 200
        if "--kill-every" not in given:
            args.kill_every = 300

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
            "--local-workers", "0" if args.faults else str(args.workers),
            "--cluster-secret-file", str(REPO / "target/soak-secret"),
            "--no-discovery",
            "--max-queued-requests", str(args.concurrency * 2),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    remote = RemoteWorkers(args, quic) if args.faults else None
    try:
        if remote:
            await asyncio.sleep(1)
            remote.start_all()
        await wait_ready(port, args.workers, 120)
        cases = [(p, m) for p in PROMPTS for m in MODES]
        reference = {}
        for prompt, mode in cases:
            body = {"prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True, **MODES[mode]}
            tokens, err = await post(port, body, stream=False)
            if err:
                raise SystemExit(f"reference for {mode!r} failed: {err}")
            reference[(prompt, mode)] = tokens

        totals = {"streams_ok": 0, "streams_failed": 0, "lost": 0, "repeated": 0, "wrong": 0, "kills": 0, "flaps": 0}
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
            next_flap = time.time() + args.flap_every
            faults = random.Random(args.seed)
            while time.time() < deadline:
                samples.append((time.time(), *proc_stats(coordinator.pid)))
                if time.time() >= next_kill:
                    if remote:
                        remote.kill(faults.randrange(args.workers))
                        totals["kills"] += 1
                    else:
                        pids = worker_pids(coordinator.pid)
                        if pids:
                            os.kill(faults.choice(pids), signal.SIGKILL)
                            totals["kills"] += 1
                    next_kill += args.kill_every
                if remote and time.time() >= next_flap:
                    remote.flap(faults.randrange(args.workers), args.flap_for)
                    totals["flaps"] += 1
                    next_flap += args.flap_every
                if remote:
                    remote.tend()
                await asyncio.sleep(1)

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
            "faults": remote.describe() if remote else None,
            "failures": failures,
        }
        print(json.dumps(report, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
        bad = report["lost"] + report["repeated"] + report["wrong"] + report["streams_failed"]
        return 1 if bad else 0
    finally:
        if remote:
            remote.stop()
        coordinator.send_signal(signal.SIGTERM)
        try:
            coordinator.wait(timeout=40)
        except subprocess.TimeoutExpired:
            coordinator.kill()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
