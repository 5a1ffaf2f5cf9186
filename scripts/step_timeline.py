"""One decode step's kernels in launch order, from a Chrome trace of ``scripts/profile_step.py`` (PROFILE_TRACE).

    python scripts/step_timeline.py TRACE.json [STEPS] [ROWS]

STEPS: how many steps the trace holds (profile_step profiles 20). Prints the kernels of the step in the middle:
start from the step's first kernel, duration and the gap since the previous kernel ended (negative: the kernel
started before it, as dependent launches do), then per kernel name the count, mean duration and mean gap over all
steps, and the step's span against its kernels' busy time (the union of their intervals).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def kernels(path: str) -> list[tuple[float, float, str]]:
    """(start µs, duration µs, name) of every GPU kernel in the trace, by start."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    found = [(e["ts"], e.get("dur", 0.0), e["name"]) for e in events if e.get("cat") == "kernel" and "ts" in e]
    return sorted(found)


def split_steps(found: list[tuple[float, float, str]], steps: int) -> list[list[tuple[float, float, str]]]:
    """The kernels cut into ``steps`` groups at the widest gaps between one kernel's end and the next start."""
    gaps = sorted(range(1, len(found)), key=lambda i: found[i][0] - (found[i - 1][0] + found[i - 1][1]),
                  reverse=True)
    cuts = sorted(gaps[:steps - 1])
    groups, begin = [], 0
    for cut in [*cuts, len(found)]:
        groups.append(found[begin:cut])
        begin = cut
    return groups


def busy(step: list[tuple[float, float, str]]) -> float:
    """The union of the kernels' intervals, µs."""
    total, reach = 0.0, float("-inf")
    for start, dur, _ in step:
        end = start + dur
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def short(name: str) -> str:
    return name if len(name) <= 60 else name[:57] + "..."


def main() -> None:
    path = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    rows = int(sys.argv[3]) if len(sys.argv) > 3 else 60
    groups = [g for g in split_steps(kernels(path), steps) if g]
    middle = groups[len(groups) // 2]
    origin = middle[0][0]
    print(f"step {len(groups) // 2} of {len(groups)}: {len(middle)} kernels")
    print(f"{'start':>8} {'dur':>7} {'gap':>7}  kernel")
    reach = origin
    for start, dur, name in middle[:rows]:
        print(f"{start - origin:8.1f} {dur:7.2f} {start - reach:7.2f}  {short(name)}")
        reach = max(reach, start + dur)
    per_name: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for group in groups:
        reach = group[0][0]
        for start, dur, name in group:
            per_name[name].append((dur, start - reach))
            reach = max(reach, start + dur)
    print(f"\n{'per step':>8} {'mean dur':>9} {'mean gap':>9}  kernel")
    for name, seen in sorted(per_name.items(), key=lambda kv: -sum(d for d, _ in kv[1])):
        print(f"{len(seen) / len(groups):8.1f} {statistics.mean(d for d, _ in seen):9.2f} "
              f"{statistics.mean(g for _, g in seen):9.2f}  {short(name)}")
    spans = [g[-1][0] + g[-1][1] - g[0][0] for g in groups]
    print(f"\nstep span median {statistics.median(spans):.1f} µs, kernels busy median "
          f"{statistics.median(busy(g) for g in groups):.1f} µs, sum of durations median "
          f"{statistics.median(sum(d for _, d, _ in g) for g in groups):.1f} µs, "
          f"kernels a step {statistics.median(len(g) for g in groups):.0f}")


if __name__ == "__main__":
    main()
