"""Speculative decoding against plain decoding, side by side in one process (EAGLE chain, graphs on).

Full acceptance by construction, so that the timing is that of a perfect draft at the real shapes:
the target is the preset's shapes with random weights whose every o_proj and down_proj is zero, so
no layer adds to the residual stream and the next token is argmax(lm_head(norm(embed(token)))); the
EAGLE head (random q/k/v and gate/up, o_proj and down_proj zero, fc = [I, 0], a final norm of ones)
computes exactly that. Zero weights cost a dense GEMM what random ones do. With --token-map N the
lm_head rows past N are zero too, so the target's tokens stay among the ids the draft may propose.

1. Verify against decode: one runner forward of TARGET_VERIFY with the draft's tokens per request
   against one DECODE forward, both replaying captured graphs, at batch 1, 4 and 8 (context 512).
2. Tokens/s at batch 1: plain, EAGLE, and EAGLE drafting among the first --token-map ids
   (--speculative-token-map: a smaller lm_head in every draft step); the acceptance length beside.
3. Draft graph memory: growth of the shared graph pool when the draft graphs are captured after the
   target's, against a second copy of the draft graphs captured into a pool of their own.

    python -m bench.spec --backend triton --token-map 32768
"""

from __future__ import annotations

import argparse
import json
import tempfile
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file

from backplane import Engine, SamplingParams
from bench import report, steps
from bench.timing import wall_ms

NUM_DRAFT, STEPS = 8, 7
COMMON = dict(max_total_tokens=60000, max_running_requests=8, cuda_graph_max_bs=8, disable_radix_cache=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = report.parser(__doc__)
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--backend", default="triton")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--token-map", type=int, default=32768, metavar="N", help="also draft among the first N ids (0: no)")
    p.add_argument("--verify-batch-sizes", type=int, nargs="*", default=[1, 4, 8])
    return p.parse_args(argv)


def write_checkpoints(folder: Path, model: str, dtype: torch.dtype, device: str, num_ids: int) -> tuple[str, str]:
    """(target, EAGLE head) directories of the construction in the module docstring; with num_ids,
    the lm_head rows past it are zero, so the target only ever picks a token among the first num_ids."""
    from backplane.models.presets import dummy_weights, get_preset
    from backplane.models.weights import llama_checkpoint_shapes

    config = get_preset(model)
    silent = ("o_proj.weight", "down_proj.weight")  # a layer with these zero leaves the residual stream as it is
    tensors = {name: (torch.zeros_like(t) if name.endswith(silent) else t).to(dtype).cpu()
               for name, t in dummy_weights(llama_checkpoint_shapes(config, False, False), 0, device)}
    tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])[num_ids or config.vocab_size:] = 0
    head = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.layers.0.")}
    head.pop("layers.0.input_layernorm.weight")  # EAGLE heads drop it: identity
    hidden = config.hidden_size
    head.update({"fc.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1).to(dtype),
                 "norm.weight": torch.ones(hidden, dtype=dtype)})
    for name, weights, arch, layers in (("target", tensors, "LlamaForCausalLM", config.num_hidden_layers),
                                        ("head", head, "LlamaForCausalLMEagle", 1)):
        (folder / name).mkdir()
        save_file(weights, str(folder / name / "model.safetensors"))
        doc = {**config.to_dict(), "architectures": [arch], "num_hidden_layers": layers}
        (folder / name / "config.json").write_text(json.dumps(doc))
    return str(folder / "target"), str(folder / "head")


def tokens_per_s(engine: Engine, prompt: list[int], n: int) -> dict:
    """Greedy generation of n tokens at batch 1: tokens/s, and the acceptance length under speculation."""
    engine.generate(input_ids=[prompt], sampling_params=steps.greedy(16))  # warm-up
    stats = getattr(engine.spec_worker, "stats", None)
    before = (stats.tokens, stats.request_steps) if stats else (0, 0)
    seconds, _ = steps.timed_generate(engine, [prompt], steps.greedy(n))
    accepted = (stats.tokens - before[0]) / max(stats.request_steps - before[1], 1) if stats else None
    return {"tok_s": n / seconds, "acceptance_length": accepted}


@torch.inference_mode()
def verify_vs_decode(engine: Engine, batch_sizes: list[int], vocab: int, context: int = 512) -> list[dict]:
    """One runner forward each, on batches built beforehand: DECODE (1 token a request) and
    TARGET_VERIFY (NUM_DRAFT tokens a request, a chain mask); with graphs each is one replay plus
    the backend's replay metadata."""
    from backplane.scheduler.batch_builder import build_decode_batch, build_extend_batch
    from backplane.scheduler.request import Req
    from backplane.speculative import DraftTree, alloc_verify_slots, verify_mask
    from backplane.speculative.verify_batch import build_verify_batch

    runner, rows = engine.runner, []
    kv, req_pool = runner.token_to_kv_pool, runner.req_to_token_pool
    for bs in batch_sizes:
        reqs = [Req(i, torch.randint(3, vocab, (context,)).tolist(), SamplingParams()) for i in range(bs)]
        for req in reqs:
            req.row = req_pool.alloc()
        runner.forward(build_extend_batch(reqs, [context] * bs, kv, req_pool))
        for req in reqs:
            req.num_cached = context - 1  # the last prompt token plays the last generated one
        decode = build_decode_batch(reqs, kv, req_pool)
        for req in reqs:
            kv.free(req.slots.pop())
        slots = alloc_verify_slots(reqs, NUM_DRAFT, kv, req_pool)
        tree = DraftTree.chain(torch.randint(3, vocab, (bs, NUM_DRAFT)))
        mask, indptr = verify_mask(tree, [r.num_cached for r in reqs])
        positions = (torch.tensor([r.num_cached for r in reqs])[:, None] + tree.depths).view(-1)
        verify = build_verify_batch(reqs, tree.tokens.view(-1).tolist(), positions.tolist(), slots, NUM_DRAFT, mask,
                                    indptr, req_pool, kv)
        d, v = (wall_ms(partial(runner.forward, b), runner.device) for b in (decode, verify))
        graphs = runner.graph_runner
        rows.append({"batch_size": bs, "decode_ms": d, "verify_ms": v, "ratio": v / d,
                     "graphs": graphs is not None and None not in (graphs.key_for(decode), graphs.key_for(verify))})
        for req in reqs:
            kv.free(torch.cat(req.slots))
            req_pool.free(req.row)
    return rows


def draft_graph_memory(engine: Engine) -> dict | None:
    """MB the draft graphs added to the shared pool, against the same graphs captured into their own
    pool. NOTE: the second runner re-points the draft backends' graph buffers: call it last."""
    from backplane.plugins.spec_eagle.graph import DraftGraphRunner

    shared = engine.spec_worker.graphs
    if shared is None:
        return None
    alone = DraftGraphRunner(engine.spec_worker, pool=torch.cuda.graph_pool_handle())
    alone.capture()
    return {"target_graphs_mb": engine.runner.graph_runner.graph_memory_bytes / 2**20,
            "draft_shared_mb": shared.graph_memory_bytes / 2**20, "draft_alone_mb": alone.graph_memory_bytes / 2**20}


def engine_settings(ns: argparse.Namespace, folder: Path, config) -> dict[str, dict]:
    """Each run's Engine settings: plain, EAGLE drafting among the first --token-map ids (unless 0), EAGLE."""
    dtype = torch.bfloat16 if ns.device == "cuda" else torch.float32
    target, head = write_checkpoints(folder, ns.model, dtype, ns.device, ns.token_map)
    plain = dict(COMMON, model=target, device=ns.device, dtype=str(dtype).removeprefix("torch."),
                 attention_backend=ns.backend, context_length=min(4096, config.max_position_embeddings))
    options = {"draft_model": head, "num_steps": STEPS, "topk": 1}
    eagle = dict(plain, speculative_algorithm="eagle", speculative_num_draft_tokens=NUM_DRAFT, plugin_options={"eagle": options})
    torch.save(torch.arange(ns.token_map), folder / "token_map.pt")
    mapped = dict(eagle, plugin_options={"eagle": dict(options, token_map=str(folder / "token_map.pt"))})
    return {"plain": plain, **({f"eagle, token map {ns.token_map}": mapped} if ns.token_map else {}), "eagle": eagle}


def eagle_figures(ns: argparse.Namespace, engine: Engine, prompt: list[int], vocab: int) -> dict:
    """The EAGLE engine's tokens/s at batch 1, its verify against decode forwards and its draft graphs' memory."""
    return {"batch1": {"run": "eagle", **tokens_per_s(engine, prompt, ns.new_tokens)},
            "verify_vs_decode": verify_vs_decode(engine, ns.verify_batch_sizes, vocab),
            "draft_graph_memory": draft_graph_memory(engine) if ns.device == "cuda" else None}


def measure(ns: argparse.Namespace, folder: Path) -> dict:
    """Plain, EAGLE with a token map, then EAGLE (kept for the forward timings and the graph pool)."""
    from backplane.models.presets import get_preset

    config = get_preset(ns.model)
    runs, vocab = engine_settings(ns, folder, config), min(1000, config.vocab_size)
    prompt = torch.randint(3, vocab, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    batch1 = [{"run": name, **steps.with_engine(settings, lambda e: tokens_per_s(e, prompt, ns.new_tokens))}
              for name, settings in runs.items() if name != "eagle"]
    eagle = steps.with_engine(runs["eagle"], lambda e: eagle_figures(ns, e, prompt, vocab))
    batch1.append(eagle.pop("batch1"))
    return {"batch1": [row | {"speedup": row["tok_s"] / batch1[0]["tok_s"]} for row in batch1], **eagle}


def main(argv: list[str] | None = None) -> dict:
    ns = parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        result = measure(ns, Path(folder))
    report.write_result("spec", f"{ns.model}-{ns.backend}", {"args": vars(ns), **result}, ns.out, ns.device)
    print(report.table(result["verify_vs_decode"], [("bs", "batch_size", "d"), ("decode ms", "decode_ms", ".3f"),
                       (f"verify({NUM_DRAFT}) ms", "verify_ms", ".3f"), ("ratio", "ratio", ".2f"), ("graphs", "graphs", "")]))
    print(report.table(result["batch1"], [("batch 1", "run", ""), ("tok/s", "tok_s", ".0f"), ("x plain", "speedup", ".2f"),
                                          ("acceptance length", "acceptance_length", ".2f")]))
    pools = result["draft_graph_memory"]
    if pools:
        print(f"graph pool: target {pools['target_graphs_mb']:.1f} MB; draft graphs added {pools['draft_shared_mb']:.1f} "
              f"MB to it, {pools['draft_alone_mb']:.1f} MB in a pool of their own")
    return result


if __name__ == "__main__":
    main()
