"""Speculative decoding on one GPU, preset llama-3.2-1b (dummy weights).

1. Verify vs decode: one runner forward of TARGET_VERIFY with 8 draft tokens per request against
   one DECODE forward, both through the captured graphs, at batch 1, 4 and 8 (context 512).
2. End to end at batch 1: tokens/s of greedy generation with EAGLE (chain of 7 steps, 8 draft
   tokens) at full acceptance against plain decoding. The head is random (a real EAGLE layer of
   the 1B shapes, so every draft step costs what it would); two ways to full acceptance:
   - fixed point: its token choices are replaced by the target's own greedy continuation, computed
     beforehand (on dummy weights the logits are flat, so bf16 near-ties cut this short);
   - forced: every drafted token is accepted whatever the target chose (timing only: the tokens
     are not the target's; draft, verify, KV commit and feature hand-over run exactly as at full
     acceptance).
   With --token-map N, the fixed-point figure is also measured for the same head drafting among
   the first N token ids only (--speculative-token-map: a smaller lm_head in every draft step).
3. Draft graph memory: growth of the shared pool when the draft graphs are captured after the
   target's, against a second copy of the draft graphs captured into a pool of their own.

    python bench/spec.py --out spec.json [--backend triton|flashinfer] [--phases] [--token-map 32768]
    python bench/spec.py --model tiny-llama --device cpu --backend torch_native --new-tokens 24   # smoke run
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file

from backplane import Engine, SamplingParams
from backplane.engine.batch_builder import build_decode_batch, build_extend_batch
from backplane.engine.request import Req
from backplane.speculative import DraftTree, alloc_verify_slots, verify_mask

NUM_DRAFT, STEPS = 8, 7
COMMON = dict(max_total_tokens=60000, context_length=4096, max_running_requests=8, cuda_graph_max_bs=8)


def random_head(folder: Path, config, dtype: torch.dtype) -> str:
    """An EAGLE checkpoint of the target's shapes with random weights (std 0.02)."""
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes = {"fc.weight": (h, 2 * h), "layers.0.self_attn.q_proj.weight": (q, h),
              "layers.0.self_attn.k_proj.weight": (kv, h), "layers.0.self_attn.v_proj.weight": (kv, h),
              "layers.0.self_attn.o_proj.weight": (h, q), "layers.0.mlp.gate_proj.weight": (inter, h),
              "layers.0.mlp.up_proj.weight": (inter, h), "layers.0.mlp.down_proj.weight": (h, inter)}
    tensors = {name: (0.02 * torch.randn(shape)).to(dtype) for name, shape in shapes.items()}
    tensors["layers.0.post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
    save_file(tensors, str(folder / "model.safetensors"))
    doc = config.to_dict()
    doc.update(num_hidden_layers=1, architectures=["LlamaForCausalLMEagle"])
    (folder / "config.json").write_text(json.dumps(doc))
    return str(folder)


def common_dtype(common: dict) -> torch.dtype:
    return getattr(torch, common["dtype"])


def median_ms(fn, device: str, repeat: int = 30) -> float:
    """Median wall time of `fn` (synchronised), after two warm-up calls."""
    times = []
    for _ in range(repeat + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


@torch.inference_mode()
def verify_vs_decode(engine: Engine, batch_sizes: list[int], vocab: int, context: int = 512) -> list[dict]:
    """One runner forward each: DECODE (1 token per request) and TARGET_VERIFY (NUM_DRAFT tokens per
    request, chain mask), both on batches built beforehand; with graphs each is one replay plus the
    backend's replay metadata."""
    from backplane.speculative.verify_batch import build_verify_batch

    runner = engine.runner
    rows = []
    for bs in batch_sizes:
        reqs = [Req(i, torch.randint(3, vocab, (context,)).tolist(), SamplingParams()) for i in range(bs)]
        for req in reqs:
            req.row = runner.req_to_token_pool.alloc()
        runner.forward(build_extend_batch(reqs, [context] * bs, runner.token_to_kv_pool, runner.req_to_token_pool))
        for req in reqs:
            req.num_cached = context - 1  # the last prompt token plays the last generated one
        decode_batch = build_decode_batch(reqs, runner.token_to_kv_pool, runner.req_to_token_pool)
        for req in reqs:
            runner.token_to_kv_pool.free(req.slots.pop())
        slots = alloc_verify_slots(reqs, NUM_DRAFT, runner.token_to_kv_pool, runner.req_to_token_pool)
        tree = DraftTree.chain(torch.randint(3, vocab, (bs, NUM_DRAFT)))
        mask, indptr = verify_mask(tree, [r.num_cached for r in reqs])
        positions = (torch.tensor([r.num_cached for r in reqs])[:, None] + tree.depths).view(-1)
        verify_batch = build_verify_batch(reqs, tree.tokens.view(-1).tolist(), positions.tolist(), slots, NUM_DRAFT,
                                          mask, indptr, runner.req_to_token_pool, runner.token_to_kv_pool)
        d = median_ms(partial(runner.forward, decode_batch), runner.device.type)
        v = median_ms(partial(runner.forward, verify_batch), runner.device.type)
        graphs = runner.graph_runner
        rows.append({"batch_size": bs, "decode_ms": d, "verify_ms": v, "ratio": v / d,
                     "decode_graph": graphs is not None and graphs.key_for(decode_batch) is not None,
                     "verify_graph": graphs is not None and graphs.key_for(verify_batch) is not None})
        for req in reqs:
            runner.token_to_kv_pool.free(torch.cat(req.slots))
            runner.req_to_token_pool.free(req.row)
    return rows


def force_acceptance(worker, oracle: list[list[int]], prompt_len: int) -> None:
    """Replace the drafted chain by oracle[0], the target's known continuation (the draft compute
    still runs); oracle is a one-element list so that the caller can swap the continuation."""
    draft = worker.draft

    def drafted(reqs):
        tree = draft(reqs)
        for b, req in enumerate(reqs):
            done = len(req.all_ids) - prompt_len
            want = oracle[0][done:done + tree.num_nodes - 1]
            tokens = tree.tokens if tree.tokens is not None else tree.device_tokens
            with torch.inference_mode():  # the draft's tensors are inference tensors
                tokens[b, 1:1 + len(want)] = torch.tensor(want, device=tokens.device)
        return tree

    worker.draft = drafted


def accept_every_draft():
    """Patch greedy acceptance to take the whole draft chain (timing only). Returns an undo.

    The target's choice at every node with a child is replaced by its first child's token, so the
    acceptance walk itself descends the whole chain and keeps the target's own bonus token."""
    import backplane.speculative.worker as core_worker

    original = core_worker.verify_greedy

    def accept_all(tree: DraftTree, target_choice: torch.Tensor) -> list:
        choice = target_choice.clone()
        for b in range(tree.batch_size):
            for child in range(tree.num_nodes - 1, 0, -1):  # descending: the first child is written last
                choice[b, tree.parents[b, child]] = tree.tokens[b, child]
        return original(tree, choice)

    core_worker.verify_greedy = accept_all
    return lambda: setattr(core_worker, "verify_greedy", original)


def time_phases(engine: Engine) -> tuple[dict[str, list[float]], callable]:
    """Wrap the speculative step's phases with synchronised timers; returns (times, undo).

    Each phase is timed with the device synchronised before and after, so GPU and host time are
    both counted and nothing overlaps (the totals exceed an unsynchronised step by the syncs)."""
    worker, runner = engine.spec_worker, engine.runner
    cuda = runner.device.type == "cuda"
    times: dict[str, list[float]] = {}
    undo = []

    def wrap(obj, attr: str, label: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
            times.setdefault(label, []).append((time.perf_counter() - start) * 1e3)
            return out

        setattr(obj, attr, timed)
        undo.append(lambda: obj.__dict__.pop(attr, None))

    wrap(worker, "decode", "whole step")
    wrap(worker, "draft", "draft")
    wrap(worker, "_draft_pending", "  draft, pending tokens (eager)")
    wrap(worker, "_draft_window_eager", "  draft, window (eager)")
    if worker.graphs is not None:
        wrap(worker.graphs, "replay", "  draft, window (graph)")
    wrap(worker, "verify", "verify")
    wrap(runner, "forward", "  target forward")
    wrap(worker, "after_verify", "after verify")
    return times, lambda: [u() for u in undo]


def draft_graph_memory(engine: Engine) -> dict | None:
    """MB the draft graphs added to the shared pool, against the same graphs captured alone.

    The second runner re-initialises the draft backends' graph buffers: the engine's own draft
    graphs must not be replayed afterwards."""
    from backplane.plugins.spec_eagle.graph import DraftGraphRunner
    from backplane.speculative.draft_parts import graph_pool

    shared = engine.spec_worker.graphs
    if shared is None:
        return None
    from backplane.executor.graph_runner import pool_bytes

    target_mb = engine.runner.graph_runner.graph_memory_bytes / 2**20
    alone = DraftGraphRunner(engine.spec_worker, pool=torch.cuda.graph_pool_handle())
    alone.capture()
    row = {"target_graphs_mb": target_mb, "draft_shared_mb": shared.graph_memory_bytes / 2**20,
           "draft_alone_mb": alone.graph_memory_bytes / 2**20, "shared_pool_mb": pool_bytes(graph_pool()) / 2**20}
    del alone
    return row


@torch.inference_mode()
def kernel_profile(engine: Engine, vocab: int, context: int = 512, top: int = 10) -> dict[str, list]:
    """GPU time by kernel of one eager DECODE and one eager TARGET_VERIFY forward at batch 1."""
    from torch.profiler import ProfilerActivity, profile

    from backplane.speculative.verify_batch import build_verify_batch

    runner = engine.runner
    req = Req(0, torch.randint(3, vocab, (context,)).tolist(), SamplingParams())
    req.row = runner.req_to_token_pool.alloc()
    runner.forward(build_extend_batch([req], [context], runner.token_to_kv_pool, runner.req_to_token_pool))
    req.num_cached = context - 1
    decode = build_decode_batch([req], runner.token_to_kv_pool, runner.req_to_token_pool)
    runner.token_to_kv_pool.free(req.slots.pop())
    slots = alloc_verify_slots([req], NUM_DRAFT, runner.token_to_kv_pool, runner.req_to_token_pool)
    tree = DraftTree.chain(torch.randint(3, vocab, (1, NUM_DRAFT)))
    mask, indptr = verify_mask(tree, [req.num_cached])
    positions = (req.num_cached + tree.depths).view(-1)
    verify = build_verify_batch([req], tree.tokens.view(-1).tolist(), positions.tolist(), slots, NUM_DRAFT, mask,
                                indptr, runner.req_to_token_pool, runner.token_to_kv_pool)
    tables = {}
    for name, batch in (("decode", decode), ("verify", verify)):
        for _ in range(3):
            runner.forward_eager(batch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runner.forward_eager(batch)
            torch.cuda.synchronize()
        rows = [(e.key, e.device_time_total / 5, e.count // 5) for e in prof.key_averages()
                if e.device_time_total > 0]
        rows.sort(key=lambda r: -r[1])
        tables[name] = [{"kernel": k[:70], "us_per_forward": t, "launches": c} for k, t, c in rows]
    runner.token_to_kv_pool.free(torch.cat(req.slots))
    runner.req_to_token_pool.free(req.row)
    for name, rows in tables.items():
        total = sum(r["us_per_forward"] for r in rows)
        print(f"{name}: {total:.0f} us of kernels per eager forward; top {top}:")
        for r in rows[:top]:
            print(f"  {r['us_per_forward']:8.1f} us  x{r['launches']:<4} {r['kernel']}")
    return tables


def tokens_per_s(engine: Engine, prompt: list[int], n: int, on_start=None) -> tuple[float, list[int]]:
    params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    engine.generate(input_ids=[prompt], sampling_params=SamplingParams(max_new_tokens=16, temperature=0))
    if on_start is not None:
        on_start()
    cuda = engine.runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = engine.generate(input_ids=[prompt], sampling_params=params)[0]
    if out.error:
        raise RuntimeError(f"generation failed, no timing to report: {out.error}")
    if cuda:
        torch.cuda.synchronize()
    return n / (time.perf_counter() - start), out.token_ids


def fixed_point(engine: Engine, prompt: list[int], oracle: list[int], new_tokens: int, plain_tps: float) -> dict:
    """Tokens/s drafting the target's own greedy continuation. In bf16 the verify pass may break a
    near-tie differently from plain decoding, after which plain's continuation is no longer the
    target's; so the continuation is iterated to a fixed point (drafting what verify chose)."""
    worker = engine.spec_worker
    pad = [0] * NUM_DRAFT
    current = [oracle + pad]
    draft = worker.draft
    force_acceptance(worker, current, len(prompt))

    def fresh_stats():
        worker.stats = type(worker.stats)()

    for rounds in range(1, 6):  # noqa: B007 - the count of rounds is reported after the loop
        tps, ids = tokens_per_s(engine, prompt, new_tokens, on_start=fresh_stats)
        if ids + pad == current[0]:
            break
        current[0] = ids + pad
    worker.draft = draft
    first_diff = next((j for j, (a, b) in enumerate(zip(ids, oracle)) if a != b), None)
    return dict(eagle_full_acceptance_tok_s=tps, speedup=tps / plain_tps,
                acceptance_length=worker.stats.mean_acceptance_length, continuation_rounds=rounds,
                same_tokens_as_plain=ids == oracle, first_difference_from_plain=first_diff)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="triton")
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--profile", action="store_true", help="also print GPU time by kernel, decode vs verify")
    p.add_argument("--verify-kernel", choices=["extend", "split"], default=None,
                   help="the triton backend's TARGET_VERIFY kernel (default: the backend's own default)")
    p.add_argument("--acceptance", choices=["both", "forced", "fixed-point"], default="both",
                   help="how full acceptance is reached (see the module doc)")
    p.add_argument("--phases", action="store_true",
                   help="also time the speculative step's phases (synchronised) at forced full acceptance")
    p.add_argument("--token-map", type=int, default=0, metavar="N",
                   help="also measure the full-acceptance tokens/s with a token map of the first N ids")
    p.add_argument("--out", default=None)
    ns = p.parse_args()
    from backplane.models.presets import get_preset

    vocab = min(1000, get_preset(ns.model).vocab_size)
    prompt = torch.randint(3, vocab, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    common = dict(COMMON, device=ns.device, dtype="bfloat16" if ns.device == "cuda" else "float32")
    plain = Engine(ns.model, attention_backend=ns.backend, **common)
    plain_tps, oracle = tokens_per_s(plain, prompt, ns.new_tokens)
    config = plain.runner.hf_config
    del plain
    if ns.device == "cuda":
        torch.cuda.empty_cache()
    plugin_options = {"triton-attention": {"verify_kernel": ns.verify_kernel}} if ns.verify_kernel else None
    folder = tempfile.mkdtemp()  # the head (and a token map): removed at the end
    head_dir = random_head(Path(folder), config, common_dtype(common))
    eagle = Engine(ns.model, attention_backend=ns.backend, speculative_algorithm="eagle", speculative_draft_model=head_dir,
                   speculative_num_steps=STEPS, speculative_eagle_topk=1, speculative_num_draft_tokens=NUM_DRAFT,
                   plugin_options=plugin_options, **common)
    verify_rows = verify_vs_decode(eagle, [1, 4, 8], vocab)
    profiles = None
    if ns.profile:
        try:
            profiles = kernel_profile(eagle, vocab)
        except Exception as exc:  # noqa: BLE001 - a diagnostic; the measurements go on without it
            print(f"kernel profile failed: {type(exc).__name__}: {exc}")
    worker = eagle.spec_worker

    def fresh_stats():
        worker.stats = type(worker.stats)()

    batch1 = {"plain_tok_s": plain_tps,
              "draft_graph_mb": worker.graphs.graph_memory_bytes / 2**20 if worker.graphs else None}
    if ns.acceptance in ("both", "forced"):
        undo = accept_every_draft()
        try:
            forced_tps, _ = tokens_per_s(eagle, prompt, ns.new_tokens, on_start=fresh_stats)
        finally:
            undo()
        batch1.update(forced_tok_s=forced_tps, forced_speedup=forced_tps / plain_tps,
                      forced_acceptance_length=worker.stats.mean_acceptance_length)
        if ns.phases:
            undo = accept_every_draft()
            times, unwrap = time_phases(eagle)
            try:
                tokens_per_s(eagle, prompt, 128)
            finally:
                unwrap()
                undo()
            batch1["phases_ms"] = {k: statistics.median(v) for k, v in times.items()}
            print("speculative step phases at forced full acceptance (median ms, synchronised):")
            for k, v in batch1["phases_ms"].items():
                print(f"  {k:<26} {v:7.3f}")
    if ns.acceptance in ("both", "fixed-point"):
        batch1.update(fixed_point(eagle, prompt, oracle, ns.new_tokens, plain_tps))
    if ns.token_map:
        # The same head drafting among the first N token ids only (a smaller lm_head per draft step).
        token_map = Path(folder) / "token_map.pt"
        torch.save(torch.arange(ns.token_map), token_map)
        mapped = Engine(ns.model, attention_backend=ns.backend, speculative_algorithm="eagle",
                        speculative_draft_model=head_dir, speculative_num_steps=STEPS, speculative_eagle_topk=1,
                        speculative_num_draft_tokens=NUM_DRAFT, speculative_token_map=str(token_map),
                        plugin_options=plugin_options, **common)
        batch1["token_map"] = {"size": ns.token_map, **fixed_point(mapped, prompt, oracle, ns.new_tokens, plain_tps)}
        del mapped
    # Last: a second draft runner re-points the step backends' graph buffers at its own.
    pools = draft_graph_memory(eagle) if ns.device == "cuda" else None
    report = {
        "preset": ns.model, "backend": ns.backend, "verify_kernel": ns.verify_kernel or "default",
        "device": torch.cuda.get_device_name() if ns.device == "cuda" else "cpu",
        "verify_vs_decode": verify_rows, "batch1": batch1, "draft_graph_memory": pools, "kernel_profile": profiles,
    }
    print_report(report)
    if ns.out:
        Path(ns.out).write_text(json.dumps(report, indent=2))
    shutil.rmtree(folder, ignore_errors=True)


def print_report(report: dict) -> None:
    """The short table of one run: verify against decode, then the batch-1 speed-ups and graph memory."""
    print(f"{'bs':>3} {'decode ms':>10} {'verify(8) ms':>13} {'ratio':>6}")
    for r in report["verify_vs_decode"]:
        print(f"{r['batch_size']:>3} {r['decode_ms']:>10.3f} {r['verify_ms']:>13.3f} {r['ratio']:>6.2f}")
    b = report["batch1"]
    if "forced_tok_s" in b:
        print(f"batch 1, forced full acceptance: plain {b['plain_tok_s']:.0f} tok/s, eagle {b['forced_tok_s']:.0f} tok/s "
              f"= {b['forced_speedup']:.2f}x, acceptance length {b['forced_acceptance_length']:.2f}")
    if "speedup" in b:
        print(f"batch 1, target's own continuation: eagle {b['eagle_full_acceptance_tok_s']:.0f} tok/s "
              f"= {b['speedup']:.2f}x, acceptance length {b['acceptance_length']:.2f} (fixed after "
              f"{b['continuation_rounds']} rounds; first difference from plain greedy at token "
              f"{b['first_difference_from_plain']})")
    if "token_map" in b:
        t = b["token_map"]
        print(f"batch 1, target's own continuation, token map of {t['size']} ids: eagle "
              f"{t['eagle_full_acceptance_tok_s']:.0f} tok/s = {t['speedup']:.2f}x, acceptance length "
              f"{t['acceptance_length']:.2f}")
    pools = report["draft_graph_memory"]
    if pools:
        print(f"graph pool: target {pools['target_graphs_mb']:.1f} MB; draft graphs added {pools['draft_shared_mb']:.1f} MB "
              f"to it, {pools['draft_alone_mb']:.1f} MB in a pool of their own")


if __name__ == "__main__":
    main()
