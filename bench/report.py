"""Result files and tables. Every benchmark writes one JSON per subject whose payload starts with
"meta" (device, card, commit, date, versions) and whose name says the same:
`<benchmark>-<subject>-<card>-<commit>-<date>.json`, e.g. decode-llama-3.2-1b-h100-376dd02-2026-12-06.json."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
COMMIT_ENV = "BACKPLANE_BENCH_COMMIT"  # the commit where the tree has no git (the GPU machine's copy)

Column = tuple[str, str, str]  # (header, key of the row, format spec)


def parser(doc: str, device: bool = True) -> argparse.ArgumentParser:
    """A benchmark's command line: the first line of its docstring, --out, and --device unless device is False."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", default=None, help="folder for the result JSON (default: $OUT when set, else bench/results)")
    if device:
        p.add_argument("--device", default="cuda")
    return p


def card(device_name: str) -> str:
    """A short card name for file names: "NVIDIA H100 80GB HBM3" -> "h100", "cpu" -> "cpu"."""
    words = device_name.replace("NVIDIA", "").replace("-", " ").split()
    named = next((w for w in words if any(c.isdigit() for c in w)), words[0] if words else "unknown")
    return re.sub(r"[^a-z0-9]+", "-", named.lower()).strip("-") or "unknown"


def commit() -> str:
    """$BACKPLANE_BENCH_COMMIT when set, else the checkout's short commit (with -dirty when tracked files
    changed), else unknown. NOTE: the variable comes first: the GPU machine's copy of the tree may
    carry a stale git (on 2026-12-07 it described the session's first commit plus -dirty)."""
    named = os.environ.get(COMMIT_ENV)
    if named:
        return named
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True, text=True,
                             timeout=10, cwd=RESULTS.parent)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device | str = "cuda") -> dict[str, Any]:
    """What a result was measured on: device name, card, commit, UTC date and the library versions."""
    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    name = torch.cuda.get_device_name() if cuda else "cpu"
    return {"device": name, "card": card(name), "commit": commit(), "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "torch": torch.__version__, "triton": _version("triton"), "flashinfer": _version("flashinfer-python")}


def result_path(bench: str, subject: str, meta: dict[str, Any], out: str | Path | None = None) -> Path:
    folder = Path(out or os.environ.get("OUT") or RESULTS)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{bench}-{subject}-{meta['card']}-{meta['commit']}-{meta['date']}.json"


def write_result(bench: str, subject: str, payload: dict[str, Any], out: str | Path | None = None,
                 device: torch.device | str = "cuda") -> Path:
    """Write {"meta": environment(device), **payload} to result_path(...), say so, and return the path."""
    meta = environment(device)
    path = result_path(bench, subject, meta, out)
    path.write_text(json.dumps({"meta": meta, **payload}, indent=1, default=str))
    print(f"wrote {path}", flush=True)
    return path


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is missing (a figure not measured in this run)."""
    return a / b if a is not None and b else None


def add_ratios(rows: list[dict], ratios: dict[str, tuple[str, str]]) -> list[dict]:
    """Side by side: row[name] = row[a] / row[b] for each name: (a, b)."""
    for row in rows:
        row.update({name: ratio(row.get(a), row.get(b)) for name, (a, b) in ratios.items()})
    return rows


def _cell(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec and not isinstance(value, str) else str(value)


def table(rows: list[dict], columns: list[Column], title: str = "") -> str:
    """A short fixed-width table of rows (dicts) with one column per (header, key, format spec)."""
    cells = [[h for h, _, _ in columns]] + [[_cell(row.get(k), spec) for _, k, spec in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells]
    return "\n".join(([title] if title else []) + lines)


def verdict(value: float | None, target: float, at_most: bool = True) -> str:
    """"met" / "MISSED" against a target (at most or at least), "n/a" when nothing was measured."""
    if value is None:
        return "n/a"
    return "met" if (value <= target if at_most else value >= target) else "MISSED"

