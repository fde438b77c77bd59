"""Where the CUDA graph pool's memory goes: the target's graphs, then the EAGLE draft graphs.

Prints, for the process's shared pool after the target's capture, after the draft's capture, and
for a second copy of the draft graphs captured into a pool of their own, the segments and blocks
by state (active: kept by a graph as its output or internal buffer; inactive: free, reusable by a
later capture into the same pool).

    python bench/graph_pool_probe.py --model llama-3.2-1b --max-bs 16
    python bench/graph_pool_probe.py --tiny-wide          # the GPU test's 32k-vocabulary tiny target
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch


def pool_blocks(pool) -> dict:
    pool = tuple(pool)
    segs = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", (0, 0))) == pool]
    blocks = Counter()
    sizes: dict[str, list[int]] = {"active": [], "inactive": []}
    for seg in segs:
        for b in seg["blocks"]:
            state = "active" if b["state"].startswith("active") else "inactive"
            blocks[state] += b["size"]
            sizes[state].append(b["size"])
    return {"segments_mb": sum(s["total_size"] for s in segs) / 2**20, "segments": len(segs),
            "active_mb": blocks["active"] / 2**20, "inactive_mb": blocks["inactive"] / 2**20,
            "largest_inactive_mb": [round(x / 2**20, 2) for x in sorted(sizes["inactive"], reverse=True)[:6]],
            "largest_active_mb": [round(x / 2**20, 2) for x in sorted(sizes["active"], reverse=True)[:6]]}


def active_origins(pool, top: int = 6) -> list[str]:
    """The largest active blocks of `pool` with the project frames that allocated them (needs
    torch.cuda.memory._record_memory_history to have been on)."""
    pool = tuple(pool)
    rows = []
    for seg in torch.cuda.memory._snapshot()["segments"]:
        if tuple(seg.get("segment_pool_id", (0, 0))) != pool:
            continue
        for b in seg["blocks"]:
            if b["state"].startswith("active"):
                frames = [f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in b.get("frames", [])
                          if any(k in f["filename"] for k in ("/core/", "/plugins/", "/bench/"))]
                rows.append((b["size"], b["state"], " < ".join(frames[:4]) or "?"))
    rows.sort(key=lambda r: -r[0])
    return [f"{size / 2**20:7.2f} MB {state}: {where}" for size, state, where in rows[:top]]


def show(name: str, row: dict) -> None:
    print(f"{name:<28} {row['segments_mb']:8.1f} MB in {row['segments']:3d} segments; active {row['active_mb']:7.1f} MB "
          f"(largest {row['largest_active_mb']}), free {row['inactive_mb']:7.1f} MB (largest {row['largest_inactive_mb']})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--tiny-wide", action="store_true", help="a one-layer hidden-512, 32k-vocabulary target")
    p.add_argument("--max-bs", type=int, default=16)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--draft-tokens", type=int, default=8)
    ns = p.parse_args()

    from backplane import Engine
    from backplane.executor.graph_runner import global_graph_pool
    from backplane.plugins.spec_eagle.graph import DraftGraphRunner

    sys.path.insert(0, str(Path(__file__).parent))
    from spec import random_head  # noqa: E402

    torch.cuda.memory._record_memory_history(max_entries=200000)
    before_draft = {}
    capture = DraftGraphRunner.capture

    def capture_and_look(self):
        if not before_draft:
            before_draft.update(pool_blocks(global_graph_pool()))
        capture(self)

    DraftGraphRunner.capture = capture_and_look
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        if ns.tiny_wide:
            from transformers import LlamaConfig, LlamaForCausalLM

            config = LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=512, intermediate_size=1024,
                                 num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, vocab_size=32000)
            LlamaForCausalLM(config).half().save_pretrained(folder / "target", safe_serialization=True)
            model = str(folder / "target")
        else:
            from backplane.models.presets import get_preset

            config, model = get_preset(ns.model), ns.model
        (folder / "head").mkdir()
        head = random_head(folder / "head", config, torch.float16)
        engine = Engine(model, device="cuda", dtype="float16", attention_backend="triton", max_total_tokens=20000,
                        max_running_requests=ns.max_bs, cuda_graph_max_bs=ns.max_bs, speculative_algorithm="eagle",
                        speculative_draft_model=head, speculative_num_steps=ns.steps, speculative_eagle_topk=ns.topk,
                        speculative_num_draft_tokens=ns.draft_tokens)
    pool = global_graph_pool()
    target = engine.runner.graph_runner
    draft = engine.spec_worker.graphs
    print(f"target graphs {len(target.graphs)} (sizes {target.sizes}): pool grew {target.graph_memory_bytes / 2**20:.1f} MB; "
          f"draft graphs then grew it {draft.graph_memory_bytes / 2**20:.1f} MB")
    DraftGraphRunner.capture = capture
    show("shared pool, target only", before_draft)
    after = pool_blocks(pool)
    show("shared pool, both captured", after)
    alone = DraftGraphRunner(engine.spec_worker, pool=torch.cuda.graph_pool_handle())
    alone.capture()
    alone_row = pool_blocks(alone.pool)
    show("draft graphs alone", alone_row)
    print("largest blocks the target's graphs keep:", *active_origins(pool), sep="\n  ")
    print("largest blocks the draft graphs keep (own pool):", *active_origins(alone.pool), sep="\n  ")
    print(json.dumps({"target_mb": target.graph_memory_bytes / 2**20, "draft_shared_mb": draft.graph_memory_bytes / 2**20,
                      "draft_alone_mb": alone.graph_memory_bytes / 2**20, "shared": after, "target_only": before_draft, "alone": alone_row}))


if __name__ == "__main__":
    main()
