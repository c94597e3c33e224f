#!/usr/bin/env python3
"""Measures a running cluster for issue 30's pipeline figures (standard
library only): batch-1 decode time per token, the aggregate decode rate of
N concurrent streams, and, from every worker's and stage's Prometheus
endpoint (found at /v1/prometheus/targets), resident memory and the
pipeline metrics (step time, transfer per step, bubble fraction).

Greedy /generate streams of random token ids with ignore_eos; per-token
time is (last token - first token) / (tokens - 1) of each stream, so the
prefill is left out.

Usage: tools/bench_pipeline.py --url http://127.0.0.1:8080 [--streams 16]
       [--input-len 16] [--concurrent-input-len 128] [--output-len 64] [--runs 3]
       [--vocab 32000]
"""
import argparse
import json
import random
import statistics
import threading
import time
import urllib.request


def stream(url, prompt, output_len):
    """Token arrival times of one greedy /generate stream."""
    body = {"prompt_token_ids": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    times = []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            now = time.perf_counter()
            times.extend([now] * len(chunk.get("token_ids") or []))
    return times


VOCAB = 32000


def prompt(rng, n):
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def per_token_ms(times):
    return 1000 * (times[-1] - times[0]) / (len(times) - 1)


def concurrent(url, rng, streams, input_len, output_len):
    """Aggregate decode rate: every stream's tokens after its first, over the
    wall time from the first first-token to the last token."""
    results = [None] * streams
    prompts = [prompt(rng, input_len) for _ in range(streams)]

    def run(i):
        results[i] = stream(url, prompts[i], output_len)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = max(r[0] for r in results)  # every stream decoding from here on
    last = min(r[-1] for r in results)  # ... to here
    tokens = sum(sum(1 for t in r if first <= t <= last) for r in results)
    return tokens / (last - first), statistics.median(per_token_ms(r) for r in results)


def scrape(url):
    targets = json.load(urllib.request.urlopen(url + "/v1/prometheus/targets"))
    out = {}
    for group in targets:
        worker = group["labels"]["worker"]
        text = urllib.request.urlopen("http://%s/metrics" % group["targets"][0]).read().decode()
        values = {}
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0]
            if key.startswith("tinyvllm:pipeline") or key == "process_resident_memory_bytes":
                if "_bucket" in key:
                    continue
                values[key] = values.get(key, 0.0) + float(value)
        row = {"rss_mib": round(values.get("process_resident_memory_bytes", 0) / 2**20, 1)}
        for metric in ["step_seconds", "transfer_seconds", "wait_seconds", "step_sent_bytes", "step_received_bytes"]:
            n = values.get("tinyvllm:pipeline_%s_count" % metric, 0)
            if n:
                row[metric + "_mean"] = values["tinyvllm:pipeline_%s_sum" % metric] / n
                row[metric + "_count"] = n
        if "tinyvllm:pipeline_bubble_fraction" in values:
            row["bubble_fraction"] = round(values["tinyvllm:pipeline_bubble_fraction"], 3)
        out[worker] = row
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--concurrent-input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=32000, help="prompt ids are drawn below this")
    args = ap.parse_args()
    global VOCAB
    VOCAB = args.vocab
    rng = random.Random(args.seed)
    stream(args.url, prompt(rng, args.input_len), 8)  # warm up
    batch1 = [per_token_ms(stream(args.url, prompt(rng, args.input_len), args.output_len)) for _ in range(args.runs)]
    after_batch1 = scrape(args.url)
    rates = [concurrent(args.url, rng, args.streams, args.concurrent_input_len, args.output_len)
             for _ in range(max(1, args.runs - 1))]
    report = {
        "batch1_ms_per_token": [round(x, 2) for x in batch1],
        "batch1_ms_per_token_median": round(statistics.median(batch1), 2),
        "after_batch1": after_batch1,
        "concurrent_tokens_per_s": [round(r, 1) for r, _ in rates],
        "concurrent_ms_per_token_median": [round(m, 1) for _, m in rates],
        "after_all": scrape(args.url),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
