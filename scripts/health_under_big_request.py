"""How long a running server takes to answer /health while it receives and refuses one 20 MB request: the
slowest of the /health calls made (one after another) from the request's first byte until its answer.

    pocketllm serve [--max-request-bytes N] &
    python scripts/health_under_big_request.py --url http://127.0.0.1:8000 [--mb 20]

Below the server's body limit the prompt is read whole and refused by the context check; above it, the body
is a 413.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--mb", type=float, default=20)
    args = parser.parse_args()
    body = json.dumps({"model": "x", "prompt": "hello " * int(args.mb * (1 << 20) / 6), "max_tokens": 1}).encode()
    result: dict[str, object] = {}

    def big() -> None:
        started = time.monotonic()
        response = httpx.post(args.url + "/v1/completions", content=body, timeout=600,
                              headers={"Content-Type": "application/json"})
        result["status"] = response.status_code
        result["message"] = response.json().get("error", {}).get("message", "")[:100]
        result["seconds"] = time.monotonic() - started

    with httpx.Client(timeout=600) as client:
        client.get(args.url + "/health")   # the connection is open before the big request starts
        worker = threading.Thread(target=big)
        worker.start()
        slowest, calls = 0.0, 0
        while worker.is_alive():
            started = time.monotonic()
            assert client.get(args.url + "/health").status_code == 200
            slowest, calls = max(slowest, time.monotonic() - started), calls + 1
        worker.join()
    print(f"{len(body) / 1e6:.1f} MB request: {result['status']} in {result['seconds']:.2f} s "
          f"({result['message']}); /health slowest {slowest * 1000:.0f} ms over {calls} calls")


if __name__ == "__main__":
    main()
