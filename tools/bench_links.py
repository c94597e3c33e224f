#!/usr/bin/env python3
"""How much a slower link between pipeline stages adds to each token
(issue 58): a 2-stage pipeline of stories260K (release binaries), its stage
link through tinyvllm-netem with a one-way delay of D ms (no jitter, no
loss; 0 means no proxy at all), and a batch-1 greedy stream's time per
token (last token - first token over tokens - 1, median of --runs streams).
A decode step crosses the stage link twice (activations out, the sampled
token back), so the expected growth is 2 D per token; the table shows the
measured growth beside it. Standard library only.

    cargo build --release --bins -p tinyvllm-coordinator -p tinyvllm-worker -p tinyvllm-tests
    python3 tools/bench_links.py [--delays 0,1,5,10] [--tokens 128] [--runs 5]
"""

import argparse
import json
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port(kind=socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def per_token_ms(url: str, tokens: int) -> float:
    body = {"prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    times = []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                now = time.perf_counter()
                times.extend([now] * len(json.loads(line[5:]).get("token_ids") or []))
    return 1000 * (times[-1] - times[0]) / (len(times) - 1)


def wait_ready(url: str, timeout: float = 120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.1)
    raise SystemExit("the pipeline never became ready")


def measure(bins: Path, delay_ms: float, tokens: int, runs: int) -> float:
    model = str(REPO / "tests/models/stories260K")
    with tempfile.TemporaryDirectory() as tmp:
        secret = Path(tmp) / "secret"
        http, quic, later = free_port(), free_port(socket.SOCK_DGRAM), free_port(socket.SOCK_DGRAM)
        procs = []
        try:
            procs.append(subprocess.Popen(
                [bins / "tinyvllm-coordinator", "--model", model, "--http", f"127.0.0.1:{http}", "--quic",
                 f"127.0.0.1:{quic}", "--local-workers", "0", "--no-discovery", "--cluster-secret-file", secret],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            time.sleep(0.5)
            procs.append(subprocess.Popen(
                [bins / "tinyvllm-worker", "serve", "--model", model, "--layers", "3-4", "--stage-listen",
                 f"127.0.0.1:{later}", "--cluster-secret-file", secret, "--name", "stage-1"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            next_stage = f"127.0.0.1:{later}"
            if delay_ms > 0:
                link = subprocess.Popen(
                    [bins / "tinyvllm-netem", "--listen", "127.0.0.1:0", "--target", next_stage, f"delay_ms={delay_ms}"],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                procs.append(link)
                next_stage = link.stdout.readline().strip().split("listening=")[1]
            time.sleep(0.5)
            procs.append(subprocess.Popen(
                [bins / "tinyvllm-worker", "serve", "--model", model, "--layers", "0-2", "--next-stage", next_stage,
                 "--coordinator", f"127.0.0.1:{quic}", "--cluster-secret-file", secret, "--name", "stage-0"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            url = f"http://127.0.0.1:{http}"
            wait_ready(url)
            per_token_ms(url, 16)  # warm-up
            return statistics.median(per_token_ms(url, tokens) for _ in range(runs))
        finally:
            for p in reversed(procs):
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delays", default="0,1,5,10", help="one-way delays of the stage link, ms")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--bin-dir", default=str(REPO / "target/release"))
    args = ap.parse_args()
    bins = Path(args.bin_dir)
    delays = [float(d) for d in args.delays.split(",")]
    base = None
    print("| stage link, one way | ms per token | added | expected (2 x delay) |")
    print("|---|---|---|---|")
    for d in delays:
        ms = measure(bins, d, args.tokens, args.runs)
        if base is None:
            base = ms
        print(f"| {d:g} ms | {ms:.2f} | {ms - base:+.2f} | {2 * d:+.2f} |", flush=True)


if __name__ == "__main__":
    main()
