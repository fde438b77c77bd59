"""One PNG summarising the benchmark JSON files of a GPU run (what bench/gpu_suite.sh wrote).

    python bench/plot.py $OUT [more folders ...] --out $OUT/benchmarks.png   # the first file found wins

Panels (each drawn when its file is there): attention kernels against FlashInfer's best
(attention.json), decode step time against batch size with and without graphs beside the
weight-read floor (graph_runner.json), end-to-end output tokens/s against transformers and the
floor (e2e-*.json), and the LoRA / speculative ratios against their targets (lora.json, spec.json).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(folders: list[Path], name: str):
    for folder in folders:
        path = folder / name
        if path.exists():
            return json.loads(path.read_text())
    return None


def attention_panel(ax, data) -> None:
    rows = [r for r in data["rows"] if r["impl"].startswith("triton")]
    best: dict[str, dict] = {}
    for r in rows:  # the faster of the default config and the sweep's best, per case
        if r["case"] not in best or r["us"] < best[r["case"]]["us"]:
            best[r["case"]] = r
    cases = list(best)
    ax.bar(range(len(cases)), [best[c]["vs_flashinfer_best"] for c in cases],
           color=["tab:blue" if best[c]["kind"] == "decode" else "tab:orange" for c in cases])
    ax.axhline(0.9, color="tab:blue", ls="--", lw=1, label="decode target 0.9")
    ax.axhline(0.8, color="tab:orange", ls=":", lw=1, label="extend target 0.8")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_xticks(range(len(cases)), cases, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("FlashInfer best time / triton time")
    ax.set_title("triton attention vs FlashInfer (H200, bf16)")
    ax.legend(fontsize=7)


def graph_panel(ax, data) -> None:
    for result in data["results"]:
        for mode, style in (("graph", "-o"), ("eager", "--x")):
            rows = [r for r in result["rows"] if r["mode"] == mode]
            ax.plot([r["batch_size"] for r in rows], [r["decode_step_ms"] for r in rows], style,
                    label=f"{result['backend']} {mode}")
    ax.axhline(data["floor_ms"], color="k", ls=":", label=f"weight-read floor {data['floor_ms']:.2f} ms")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode step (ms)")
    ax.set_title(f"{data['model']} decode step, context {data['context']}")
    ax.legend(fontsize=7)


def e2e_panel(ax, runs: list[dict]) -> None:
    labels, values, floors, colors = [], [], [], []
    palette = {"triton": "tab:blue", "flashinfer": "tab:green", "transformers": "tab:red"}
    for run in runs:
        for kind, work in run["workloads"].items():
            for r in work["rows"]:
                labels.append(f"{run['model']}\n{kind}\n{r['backend']}")
                values.append(r["tok_s"])
                floors.append(r.get("floor_tok_s"))
                colors.append(palette.get(r["backend"], "tab:gray"))
    xs = range(len(values))
    ax.bar(xs, values, color=colors)
    ax.scatter([x for x, f in zip(xs, floors) if f], [f for f in floors if f], marker="_", s=200, color="k",
               label="floor (weights + KV reads, prefill FLOPs)")
    ax.set_yscale("log")
    ax.set_xticks(list(xs), labels, rotation=90, fontsize=6)
    ax.set_ylabel("output tokens/s")
    ax.set_title("end to end, 256 requests, graphs on")
    ax.legend(fontsize=7)


def ratio_panel(ax, lora, spec) -> None:
    names, values, targets = [], [], []
    if lora:
        names.append("LoRA step / base\n(bs 32, 8 adapters)")
        values.append(lora["results"]["lora"]["ratio_to_base"])
        targets.append(1.15)
    if spec:
        for r in spec["verify_vs_decode"]:
            names.append(f"verify(8) / decode\nbs {r['batch_size']}")
            values.append(r["ratio"])
            targets.append(1.2 if r["batch_size"] == 1 else None)
        names.append(f"EAGLE tok/s / plain\n(acceptance {spec['batch1']['acceptance_length']:.1f} of 8)")
        values.append(spec["batch1"]["speedup"])
        targets.append(2.5)
    ax.bar(range(len(values)), values, color="tab:purple")
    for x, t in enumerate(targets):
        if t is not None:
            ax.hlines(t, x - 0.4, x + 0.4, colors="k", linestyles="--")
    ax.set_xticks(range(len(names)), names, fontsize=6)
    ax.set_ylabel("ratio (dashed: target)")
    ax.set_title("LoRA overhead and speculative decoding")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", type=Path, nargs="+")
    p.add_argument("--out", type=Path, required=True)
    ns = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attention, graph = load(ns.folders, "attention.json"), load(ns.folders, "graph_runner.json")
    lora, spec = load(ns.folders, "lora.json"), load(ns.folders, "spec.json")
    e2e_files = {f.name: f for folder in reversed(ns.folders) for f in sorted(folder.glob("e2e*.json"))}
    e2e = [json.loads(f.read_text()) for _, f in sorted(e2e_files.items())]
    fig, axes = plt.subplots(2, 2, figsize=(13, 10))
    for ax, draw, data in ((axes[0][0], attention_panel, attention), (axes[0][1], graph_panel, graph),
                           (axes[1][0], e2e_panel, e2e or None)):
        if data:
            draw(ax, data)
        else:
            ax.set_axis_off()
    if lora or spec:
        ratio_panel(axes[1][1], lora, spec)
    else:
        axes[1][1].set_axis_off()
    fig.tight_layout()
    fig.savefig(ns.out, dpi=110)
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
