"""The summary of ``scripts/gpu_check.sh``: one table, and ``gpu-check.json`` beside the
results it reads (the GPU tier's JUnit XML, the benchmarks' JSON).

``python benchmarks/gpu_summary.py RESULTS [--seconds S] [--status tier=0 step=0 ...]``
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path


def tier(xml: Path) -> dict:
    """Counts of the GPU tier's tests, and each failure's and skip's name and reason."""
    out: dict = {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "skips": []}
    if not xml.exists():
        return {**out, "missing": str(xml)}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            out["failed"] += 1
            out["failures"].append(f"{name}: {(failed.get('message') or '')[:300]}")
        elif skipped is not None:
            out["skipped"] += 1
            out["skips"].append(f"{name}: {(skipped.get('message') or '')[:200]}")
        else:
            out["passed"] += 1
    return out


def read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def table(summary: dict) -> list[str]:
    t = summary["tier"]
    lines = [f"GPU tier: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped"]
    lines += [f"  FAILED {f}" for f in t["failures"]]
    lines += [f"  skipped {s}" for s in t["skips"]]
    for n, cols in (summary["step"] or {}).items():
        base = cols["torchrun"]
        row = ", ".join(f"{k} {v:.2f} ms ({v / base:.2f}x)" for k, v in cols.items())
        lines.append(f"DDP step, {n} rank(s): {row}")
    trips = summary["round_trip"] or {}
    for n, r in (trips if "ranks" not in trips else {trips["ranks"]: trips}).items():
        lines.append(
            f"trivial cell, {n} rank(s): Pool.execute {r['nbddp_pool_execute_ms']:.2f} ms, "
            f"%%ddp --quiet {r['nbddp_magic_ms']:.2f} ms ({r['device']})"
        )
    lines.append(f"status: {summary['status']}, {summary['seconds']} s in all")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--seconds", type=int, default=0)
    parser.add_argument("--status", nargs="*", default=[])
    args = parser.parse_args()
    summary = {
        "tier": tier(args.results / "gpu-tier.xml"),
        "step": read(args.results / "gpu-step.json"),
        "round_trip": read(args.results / "gpu-round-trip.json"),
        "status": dict(s.split("=", 1) for s in args.status),
        "seconds": args.seconds,
    }
    (args.results / "gpu-check.json").write_text(json.dumps(summary, indent=2))
    print("\n".join(["", "=== gpu_check summary ===", *table(summary)]))


if __name__ == "__main__":
    main()
