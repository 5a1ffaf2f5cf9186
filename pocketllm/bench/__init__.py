"""The benchmark commands (``pocketllm bench throughput | latency | serve``): JSON results and a PNG plot."""
