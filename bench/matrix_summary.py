"""Merge the combination matrix's JSON summaries (one per shard, from tests/gpu/test_combinations_gpu.py
with BACKPLANE_MATRIX_OUT) into one file and print the cells, refusals, mismatches and ties.

    python3 bench/matrix_summary.py OUT.json SHARD.json [SHARD.json ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

STATUSES = ("ok", "tie", "refused", "mismatch")


def merge(paths: list[Path]) -> dict:
    results = []
    for path in paths:
        if path.is_file():
            results += json.loads(path.read_text())["results"]
    by = {s: [r for r in results if r["status"] == s] for s in STATUSES}
    return {
        "cells": len(results), **{s: len(v) for s, v in by.items()},
        "refusals": {r["label"]: r["message"] for r in by["refused"]},
        "mismatches": {r["label"]: r["message"] for r in by["mismatch"]},
        "ties": {r["label"]: r["ties"] for r in by["tie"]},
        "seconds": round(sum(r["seconds"] for r in results), 1),
        "slowest": sorted(((round(r["seconds"], 1), r["label"]) for r in results), reverse=True)[:8],
        "results": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("shards", type=Path, nargs="+")
    args = parser.parse_args()
    doc = merge(args.shards)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"matrix: {doc['cells']} cells: {doc['ok']} equal, {doc['tie']} tie-only, {doc['refused']} refused, "
          f"{doc['mismatch']} mismatched; {doc['seconds']} s of cell time")
    for label, line in doc["refusals"].items():
        print(f"  refused  {label}: {line}")
    for label, line in doc["mismatches"].items():
        print(f"  MISMATCH {label}: {line}")
    for label, ties in doc["ties"].items():
        print(f"  tie      {label}: {ties}")
    for seconds, label in doc["slowest"]:
        print(f"  {seconds:7.1f} s  {label}")


if __name__ == "__main__":
    main()
