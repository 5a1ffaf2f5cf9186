"""Resident memory of the server process across the HTTP fuzzer's cases (tests/http_fuzz.py), in process, on the
default model: RSS after a warm-up, then after the run. Any error outside the OpenAI shape is counted.

    python scripts/fuzz_rss.py [--warmup 300] [--cases 2000]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from http_fuzz import fuzz_cases  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    from fastapi.testclient import TestClient

    from pocketllm.config import EngineArgs
    from pocketllm.server.app import ServerConfig, build_app

    parser = argparse.ArgumentParser()
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--kv-gb", type=float, default=0.05, help="KV cache size (its pages count once touched)")
    args = parser.parse_args()
    cases = fuzz_cases(args.warmup + args.cases, random.Random(31))
    app = build_app(ServerConfig(EngineArgs(max_model_len=512, cpu_kv_cache_gb=args.kv_gb)))
    with TestClient(app, raise_server_exceptions=False) as client:
        while client.get("/ready").status_code != 200:
            time.sleep(0.05)
        statuses: dict[int, int] = {}
        for index, (path, body) in enumerate(cases):
            if index == args.warmup:
                before = rss_mib()
            status = client.post(path, content=body, headers={"Content-Type": "application/json"}).status_code
            statuses[status] = statuses.get(status, 0) + 1
        after = rss_mib()
    print(f"statuses {dict(sorted(statuses.items()))}; RSS after {args.warmup} warm-up cases {before:.0f} MiB, "
          f"after {args.cases} more {after:.0f} MiB ({(after / before - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
