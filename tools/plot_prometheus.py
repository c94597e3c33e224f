#!/usr/bin/env python3
"""Plot a tinyvllm run from a real Prometheus: per-worker KV cache usage,
prefix cache hit rate and TTFT over time (docs/cluster-metrics.png).

    python3 tools/plot_prometheus.py --prometheus http://127.0.0.1:9090 \
        --start UNIX_TS --end UNIX_TS --out docs/cluster-metrics.png

Needs matplotlib (pip install matplotlib). Queries use Prometheus's HTTP
API (query_range), the same expressions as the Grafana dashboard.
"""

import argparse
import json
import urllib.parse
import urllib.request


def query_range(base, expr, start, end, step):
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{base}/api/v1/query_range?{params}") as resp:
        body = json.load(resp)
    if body.get("status") != "success":
        raise SystemExit(f"query failed: {expr}: {body}")
    return body["data"]["result"]


def series(result, label):
    out = []
    for s in result:
        name = s["metric"].get(label, "cluster")
        points = [(float(t), float(v)) for t, v in s["values"] if v not in ("NaN", "+Inf", "-Inf")]
        out.append((name, points))
    return sorted(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prometheus", default="http://127.0.0.1:9090")
    ap.add_argument("--start", type=float, required=True)
    ap.add_argument("--end", type=float, required=True)
    ap.add_argument("--step", default="1s")
    ap.add_argument("--window", default="15s", help="rate() window")
    ap.add_argument("--title", default="tinyvllm: 2 workers, shared-prefix workload, prefix_aware routing")
    ap.add_argument("--out", default="docs/cluster-metrics.png")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = args.window
    panels = [
        ("KV cache usage per worker", "vllm:kv_cache_usage_perc", "worker", 100.0, "%"),
        (
            "Prefix cache hit rate per worker",
            f"rate(vllm:prefix_cache_hits_total[{w}]) / rate(vllm:prefix_cache_queries_total[{w}])",
            "worker",
            100.0,
            "%",
        ),
        (
            "TTFT p50 / p90 (worker-side, all workers)",
            None,
            None,
            1.0,
            "s",
        ),
    ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 9), sharex=True)
    t0 = args.start
    for ax, (title, expr, label, scale, unit) in zip(axes, panels):
        if expr is None:
            lines = []
            for q in (0.5, 0.9):
                e = f"histogram_quantile({q}, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[{w}])))"
                for _, pts in series(query_range(args.prometheus, e, args.start, args.end, args.step), "le"):
                    lines.append((f"p{int(q * 100)}", pts))
        else:
            lines = series(query_range(args.prometheus, expr, args.start, args.end, args.step), label)
        for name, pts in lines:
            if pts:
                ax.plot([t - t0 for t, _ in pts], [v * scale for _, v in pts], label=name)
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    axes[-1].set_xlabel("seconds since start")
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
