"""The MoE decode step, black box, against a gpt-fast-style peer and against its read floor (issue 41).

Our engine serves a Qwen3MoeForCausalLM of Qwen3-30B-A3B's shapes with random weights (a config.json
in a temporary folder, --load-format dummy; 48 layers, hidden 2048, 32 q / 4 kv heads of 128, 128
experts, top 8, expert intermediate 768, vocab 151936, bf16 on CUDA), default settings otherwise
(CUDA graphs for the measured batch sizes, overlap on, --moe-backend auto). Its step is the whole
Engine.generate loop per decode step (bench/steps.engine_step_ms), plus the captured decode graph's
replay alone. The peer (bench/peer_moe.py) is a plain-PyTorch decode loop on the same weight
tensors, gpt-fast's shape: a static KV cache, the step under torch.compile(mode="reduce-overhead"),
gpt-fast's Mixtral MoE (each token's k experts' weights gathered, w1[ids], and contracted by einsum).

Before either is timed at a batch size, the two must compute one function: for --check-steps
tokens, the peer (fed the engine's greedy tokens after the prompt) must choose each of the engine's
tokens, or nearly tie with it (in its top 3 and within 0.25 of its logits' std of its maximum: bf16
router flips); a mismatch is reported and the run exits 1 after writing its result. Engine and peer
then alternate --rounds times (medians). The floor (batch 1): the bytes a step must read, the active
parameters (attention, norms, router, the 8 chosen experts of every layer, one embedding row, the
whole lm_head) plus the KV at the step's mean context, at the card's copy bandwidth.

Memory plan (an 80 GB H100): the weights are held once, by the engine (~61 GB in bf16): the peer's
parameters are the engine model's Parameters or aliasing views of them (w1/w3 the halves of
w13_weight; nothing copied). The engine's KV pool is capped by --max-total-tokens at
2 x max bs x (prompt + check steps + steps + 64) tokens (~1.6 GB at bs 32 and the defaults; 96 KiB
a token), graphs are captured for the measured batch sizes only, and chunked prefill is one batch
of prompts (max bs x prompt tokens) so the MoE backend's workspace stays small. The peer exists for
one batch size at a time: its KV cache (bs x (prompt + check steps + steps + 8) tokens, ~0.64 GB at
bs 32), its reduce-overhead graph pool (at bs 32 one layer's gathered expert weights, 3 x 0.8 GB),
and its eager prefill's dense experts in chunks of 512 tokens; Dynamo and the graph pools are reset
between batch sizes. Peak about 70 GB; the JSON records it.

--profile BS...: one engine step at each of those batch sizes under torch.profiler (bench/steps.profile_step,
after the timings): wall, kernel and idle ms, the top kernels and idle gaps, and every kernel grouped
(KERNEL_GROUPS_MOE, by name: attention, dense gemm, moe align / gate_up / down / sum, router, norms and
elementwise, other) with its time per step and per layer (divided by the model's layers) beside the
group's share of the read floor (moe gate_up / down: the chosen experts' w13 / w2; attention: the KV;
dense gemm: every other weight, the router's gate and the lm_head included, as their GEMMs are named
alike). On CPU the profiler sees host ops only: they stand for the kernels (the names say less there).
--moe-configs PATH: the moe_triton launch table to use (the engine's --triton-moe.configs) in place of
the bundled one for this GPU, e.g. one `python -m backplane.plugins.moe_triton.tune` just wrote.

    python -m bench.moe_decode                                # bs 1 8 32, prompt 128, 64 steps, on CUDA
    python -m bench.moe_decode --batch-sizes 1 --rounds 5
    python -m bench.moe_decode --batch-sizes 1 --custom-ops moe_route=triton   # the one-kernel router
    python -m bench.moe_decode --batch-sizes 1 --rounds 5 --profile 1 --moe-configs t.json   # where the step goes
    python -m bench.run moe-decode --budget 590               # the same, as bench/run.py's group
    python -m bench.run moe-bs1 --budget 590                  # tune at 1-32 tokens, then bs 1 on both tables, profiled
    python -m bench.moe_decode --model tiny --device cpu --backend torch_native --no-compile   # the code path

The peer's prefill, compile and check take most of a run (printed per batch size, `peer_check_s` in
the JSON); the result file is rewritten after each batch size, so a run cut short keeps the ones done.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from backplane import Engine
from bench import peer_moe, report, steps, workload
from bench.timing import KERNEL_GROUPS, copy_tb_s, timed

QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
    moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu",
    attention_bias=False, tie_word_embeddings=False, use_sliding_window=False, sliding_window=None,
    max_window_layers=48, bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16")
MODELS = {  # name -> config.json; "tiny" is for CPU smoke runs
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    # NOTE: wide enough that the dummy weights' (std 0.02) layers move the logits: at hidden 64 the
    # embedding drowned them and a peer without its MoE still chose the same tokens
    "tiny": {**QWEN3_30B_A3B, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
             "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 512, "max_position_embeddings": 512,
             "max_window_layers": 2, "bos_token_id": 1, "eos_token_id": 2},
}
TIE_FRACTION, TIE_RANK = 0.25, 3  # a near-tie: within 0.25 std of the peer's maximum logit, in its top 3
TARGET_RATIO, TARGET_FLOOR = 1.0, 1.6
COLUMNS = [("bs", "batch_size", "d"), ("engine ms", "engine_ms", ".3f"), ("peer ms", "peer_ms", ".3f"),
           ("engine/peer", "ratio", ".2f"), ("replay ms", "replay_ms", ".3f"), ("floor ms", "floor_ms", ".3f"),
           ("step/floor", "step_floor", ".2f"), ("replay/floor", "replay_floor", ".2f"), ("check", "check", "")]
# A kernel's (CUDA) or host op's (CPU) group: the first whose marks (lower case) its name contains. The
# router's renormalising sum (moe_route=native) reads as "moe sum": the names are alike.
KERNEL_GROUPS_MOE = (
    ("moe align", ("_align_",)), ("moe gate_up", ("_gate_up_kernel",)), ("moe down", ("_down_kernel",)),
    ("attention", dict(KERNEL_GROUPS)["attention"]),
    ("router", ("moe_route", "topk", "softmax", "sort")),
    ("moe sum", ("sum_functor", "aten::sum")),
    ("dense gemm", (*dict(KERNEL_GROUPS)["gemm"], "gemv", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear")),
    ("norms and elementwise", ("norm", "rotary", "silu", "elementwise", "aten::mul", "aten::add", "aten::sub",
                               "aten::div", "aten::rsqrt", "aten::pow", "aten::mean", "aten::neg", "aten::exp",
                               "aten::sigmoid", "aten::cat", "aten::copy_", "aten::_to_copy")),
)
GROUP_NAMES = [name for name, _ in KERNEL_GROUPS_MOE] + ["other"]
PROFILE_COLUMNS = [("bs", "batch_size", "d"), ("wall ms", "wall_ms", ".3f"), ("kernels ms", "kernel_ms", ".3f"),
                   ("host or gaps ms", "host_or_gap_ms", ".3f"), ("launches", "launches", ".0f")]
LAYER_COLUMNS = [("group", "group", ""), ("ms/step", "ms", ".3f"), ("us/layer", "us_per_layer", ".1f"),
                 ("launches/layer", "launches_per_layer", ".1f"), ("share", "share", ".1%"),
                 ("floor us/layer", "floor_us_per_layer", ".1f"), ("x floor", "x_floor", ".2f"),
                 ("top kernel", "top", "")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = report.parser(__doc__)
    p.add_argument("--model", choices=list(MODELS), default="qwen3-30b-a3b")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=64, help="decode steps per timed run")
    p.add_argument("--check-steps", type=int, default=4, help="greedy tokens compared before timing (>= 2)")
    p.add_argument("--rounds", type=int, default=3, help="alternating engine / peer timings per batch size")
    p.add_argument("--backend", default="triton", help="--attention-backend of the engine")
    p.add_argument("--moe-backend", default="auto", help="--moe-backend of the engine")
    p.add_argument("--no-compile", action="store_true", help="run the peer eagerly (CPU smoke runs)")
    p.add_argument("--custom-ops", nargs="*", default=[], metavar="OP=IMPL",
                   help="--custom-ops of the engine (e.g. moe_route=triton); default: the engine's own choice")
    p.add_argument("--profile", type=int, nargs="*", default=[], metavar="BS",
                   help="profile one engine step at these batch sizes (of --batch-sizes): kernels, gaps, per-layer groups")
    p.add_argument("--moe-configs", default=None, metavar="PATH",
                   help="the moe_triton launch table (--triton-moe.configs); default: the bundled one of this GPU")
    p.add_argument("--no-one-token-layout", action="store_true",
                   help="moe_triton sorts one token's pairs with align as it does more (--no-triton-moe.one-token-layout)")
    ns = p.parse_args(argv)
    if ns.check_steps < 2 or ns.steps < 1 or ns.prompt < 1 or ns.rounds < 1 or min(ns.batch_sizes) < 1:
        p.error("expected --check-steps >= 2 and --steps, --prompt, --rounds, --batch-sizes >= 1")
    if set(ns.profile) - set(ns.batch_sizes):
        p.error(f"--profile: expected batch sizes among --batch-sizes {ns.batch_sizes}, got {ns.profile}")
    return ns


def engine_settings(ns: argparse.Namespace, model_dir: Path) -> dict:
    bs = max(ns.batch_sizes)
    return dict(model=str(model_dir), load_format="dummy", device=ns.device, attention_backend=ns.backend,
                moe_backend=ns.moe_backend, custom_ops=list(ns.custom_ops), max_running_requests=bs,
                cuda_graph_bs=sorted(ns.batch_sizes),
                max_total_tokens=2 * bs * (ns.prompt + ns.check_steps + ns.steps + 64),
                chunked_prefill_size=max(bs * ns.prompt, 256),
                plugin_options=moe_options(ns))


def moe_options(ns: argparse.Namespace) -> dict | None:
    """The engine's plugin_options for moe_triton: --moe-configs and --no-one-token-layout."""
    options = {**({"configs": ns.moe_configs} if ns.moe_configs else {}),
               **({"one_token_layout": False} if ns.no_one_token_layout else {})}
    return {"triton-moe": options} if options else None


# -- the floor ------------------------------------------------------------------------------------
def _moe_layers(model) -> list:
    return [module for module in model.modules() if getattr(module, "moe_info", None) is not None]


def chosen_expert_bytes(model) -> dict[str, int]:
    """{"moe gate_up": w13 bytes, "moe down": w2 bytes} of every MoE layer's top_k experts (one token's)."""
    def chosen(module, weight):
        return module.top_k * weight[0].numel() * weight.element_size()

    layers = _moe_layers(model)
    return {"moe gate_up": sum(chosen(m, m.w13_weight) for m in layers),
            "moe down": sum(chosen(m, m.w2_weight) for m in layers)}


def bs1_weight_bytes(model) -> int:
    """Bytes of the parameters one token's decode step reads: every MoE layer's router and its top_k
    experts (not all of them), one embedding row (the whole table when tied to the lm_head), the
    whole lm_head, everything else whole; each storage once."""
    counted = {w.data_ptr() for m in _moe_layers(model) for w in (m.w13_weight, m.w2_weight)}
    total = sum(chosen_expert_bytes(model).values())
    embed = model.model.embed_tokens.weight
    if embed.data_ptr() != model.lm_head.weight.data_ptr():
        total += embed[0].numel() * embed.element_size()
        counted.add(embed.data_ptr())
    for p in model.parameters():
        if p.data_ptr() not in counted:
            counted.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def kv_bytes(model, tokens: float) -> float:
    """Bytes of K and V of `tokens` cached tokens over every layer (the KV pool's dtype: the model's)."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * tokens * next(model.parameters()).element_size()


def floor(ns: argparse.Namespace, model, tb_s: float) -> dict:
    """The bs-1 step's read floor: weights read + the KV at the engine step's mean context; its bytes
    by kernel group (group_bytes: the chosen experts' w13 and w2, the KV, every other weight)."""
    context = ns.prompt + 4 + ns.steps / 2  # engine_step_ms times steps 4 .. 4 + steps after the prompt
    weights, kv, experts = bs1_weight_bytes(model), kv_bytes(model, context), chosen_expert_bytes(model)
    groups = {**experts, "attention": kv, "dense gemm": weights - sum(experts.values())}
    return {"weight_bytes": weights, "kv_bytes": kv, "mean_context": context, "total_weight_bytes":
            workload.weight_bytes(model), "floor_ms": (weights + kv) / (tb_s * 1e12) * 1e3, "group_bytes": groups}


# -- the check --------------------------------------------------------------------------------------
def judge(logits: torch.Tensor, token: int, engine_logprob: float | None) -> dict:
    """One row of the peer's logits [vocab] against the engine's greedy token: {"status": "agree" |
    "tie" | "mismatch", "rank": how many logits beat the token's, "margin": (max - the token's) / std,
    "logprob_diff": |peer - engine| log-probability of the token (None without the engine's)}."""
    row = logits.float()
    rank, margin = int((row > row[token]).sum()), float((row.max() - row[token]) / row.std())
    diff = None if engine_logprob is None else abs(float(torch.log_softmax(row, -1)[token]) - engine_logprob)
    status = "agree" if rank == 0 else "tie" if rank < TIE_RANK and margin <= TIE_FRACTION else "mismatch"
    return {"status": status, "rank": rank, "margin": margin, "logprob_diff": diff}


def check(ns: argparse.Namespace, engine: Engine, peer, step, bs: int, device: torch.device) -> dict:
    """The engine's greedy tokens of --check-steps steps after the prompts, each judged against the
    peer's logits: the eager peer's prefill for the first, its `step` fed the engine's tokens after."""
    prompts = workload.prompts([ns.prompt] * bs, int(engine.runner.hf_config.vocab_size))
    outs = steps.timed_generate(engine, prompts, steps.greedy(ns.check_steps))[1]  # NOTE: not in inference mode
    tokens = torch.tensor([o.token_ids[: ns.check_steps] for o in outs], device=device)  # [bs, check_steps]
    with torch.inference_mode():
        judged = _judge_all(ns, peer, step, prompts, tokens, outs)
    counts = {s: sum(v["status"] == s for v in judged) for s in ("agree", "tie", "mismatch")}
    diffs = [v["logprob_diff"] for v in judged if v["logprob_diff"] is not None]
    return {**counts, "max_logprob_diff": max(diffs, default=None),
            "median_logprob_diff": statistics.median(diffs) if diffs else None,
            "not_agreeing": [v for v in judged if v["status"] != "agree"][:16]}


def _judge_all(ns: argparse.Namespace, peer, step, prompts: list[list[int]], tokens: torch.Tensor, outs) -> list[dict]:
    """judge() of every request's token at every check step: the peer's prefill, then its steps."""
    bs, device = tokens.shape[0], tokens.device
    _, logits = peer(torch.tensor(prompts, device=device), torch.zeros(1, dtype=torch.long, device=device))
    judged = [{"request": r, "step": 0, **judge(logits[r], int(tokens[r, 0]), _logprob(outs[r], 0))} for r in range(bs)]
    pos = torch.zeros(1, dtype=torch.long, device=device)
    for j in range(1, ns.check_steps):
        pos.fill_(ns.prompt + j - 1)
        logits = step(tokens[:, j - 1: j].clone(), pos)[1]
        judged += [{"request": r, "step": j, **judge(logits[r], int(tokens[r, j]), _logprob(outs[r], j))}
                   for r in range(bs)]
    return judged


def _logprob(out, j: int) -> float | None:
    logprobs = getattr(out, "logprobs", None) or []
    return logprobs[j] if j < len(logprobs) and logprobs[j] is not None else None


def check_label(result: dict) -> str:
    if result["mismatch"]:
        return f"MISMATCH {result['mismatch']}"
    return f"ok ({result['tie']} ties)" if result["tie"] else "ok"


# -- timing -------------------------------------------------------------------------------------------
def peer_step_ms(step, bs: int, start: int, num_steps: int, device: torch.device) -> float:
    """ms per step of num_steps greedy steps from position `start`, each fed the last one's ids on the
    device (the position advanced by an in-place write: no step waits for the host)."""
    ids = torch.zeros(bs, 1, dtype=torch.long, device=device)
    pos = torch.full((1,), start, dtype=torch.long, device=device)

    def run(n: int) -> None:
        nonlocal ids
        for i in range(n):
            pos.fill_(start + i)
            ids = step(ids, pos)[0].clone().view(bs, 1)

    with torch.inference_mode():
        run(3)  # warm-up
        return timed(lambda: run(num_steps), device)[0] * 1e3 / num_steps


def measure(ns: argparse.Namespace, engine: Engine, bs: int, device: torch.device) -> dict:
    """One batch size: the peer built and checked against the engine, then both timed in alternation."""
    max_len = ns.prompt + ns.check_steps + ns.steps + 8
    with torch.inference_mode():
        peer, step = peer_moe.build(engine.runner.model, bs, max_len, not ns.no_compile)
    began = time.perf_counter()
    checked = check(ns, engine, peer, step, bs, device)
    row = {"batch_size": bs, "check_result": checked, "check": check_label(checked),
           "peer_check_s": time.perf_counter() - began}  # the peer's prefill, compile and first replays
    start = ns.prompt + ns.check_steps - 1
    engine_runs, peer_runs = [], []
    for _ in range(ns.rounds):
        engine_runs.append(steps.engine_step_ms(engine, bs, ns.prompt, ns.steps))
        peer_runs.append(peer_step_ms(step, bs, start, ns.steps, device))
    row.update(engine_ms=statistics.median(engine_runs), engine_runs_ms=engine_runs,
               peer_ms=statistics.median(peer_runs), peer_runs_ms=peer_runs, replay_ms=steps.replay_ms(engine, bs))
    del peer, step
    _release()
    print(f"bs {bs}: engine {row['engine_ms']:.3f} ms, peer {row['peer_ms']:.3f} ms, check {row['check']} "
          f"(the peer's prefill, compile and check {row['peer_check_s']:.0f} s)", flush=True)
    return row


def _release() -> None:
    """Dynamo's caches and the reduce-overhead graph pools given back before the next peer."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def memory_gb(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return {"allocated_gb": torch.cuda.memory_allocated() / 1e9, "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
            "card_gb": torch.cuda.get_device_properties(device).total_memory / 1e9}


# -- the profile --------------------------------------------------------------------------------------
def kernel_group(name: str) -> str:
    """A kernel's or host op's group: the first of KERNEL_GROUPS_MOE whose marks its name contains, else "other"."""
    lowered = name.lower()
    return next((group for group, marks in KERNEL_GROUPS_MOE if any(m in lowered for m in marks)), "other")


def per_layer(profile: dict, num_layers: int, group_bytes: dict | None, tb_s: float) -> list[dict]:
    """profile_step's every kernel (profile["kernels"]) by group: one row per group of GROUP_NAMES, then
    "all kernels" (their sum) and "idle or host" (the step's wall less it), each with ms per step, µs
    and launches per layer (divided by num_layers), share of the step's wall time, the slowest kernel;
    with group_bytes (bs 1), the group's read floor per layer and the time over it."""
    rows = {g: {"group": g, "ms": 0.0, "launches": 0.0, "distinct": 0, "top": ""} for g in GROUP_NAMES}
    for name, ms, count in profile["kernels"]:  # slowest first
        row = rows[kernel_group(name)]
        row.update(ms=row["ms"] + ms, launches=row["launches"] + count, distinct=row["distinct"] + 1,
                   top=row["top"] or name[:60])
    floors = {g: b / (tb_s * 1e6) / num_layers for g, b in (group_bytes or {}).items()}  # µs per layer
    total = {"group": "all kernels", "ms": sum(r["ms"] for r in rows.values()),
             "launches": sum(r["launches"] for r in rows.values()), "distinct": len(profile["kernels"]), "top": ""}
    idle = {"group": "idle or host", "ms": profile["wall_ms"] - total["ms"], "launches": 0.0, "distinct": 0, "top": ""}
    floors["all kernels"] = sum(floors.values()) if floors else None
    out = [*rows.values(), total, idle]
    for row in out:
        row.update(us_per_layer=row["ms"] * 1e3 / num_layers, launches_per_layer=row["launches"] / num_layers,
                   share=report.ratio(row["ms"], profile["wall_ms"]), floor_us_per_layer=floors.get(row["group"]))
    return report.add_ratios(out, {"x_floor": ("us_per_layer", "floor_us_per_layer")})


def profile_tables(rows: list[dict]) -> str:
    """The profiled batch sizes: wall / kernel / idle ms, then per batch size its top kernels, idle
    gaps and the per-layer groups."""
    profiled = [r for r in rows if r.get("profile")]
    parts = [report.table([{"batch_size": r["batch_size"], **r["profile"]} for r in profiled], PROFILE_COLUMNS,
                          "one engine step under the profiler (every kernel and gap: the JSON's profile)")]
    for r in profiled:
        top = [{"name": n, "ms": ms, "count": c} for n, ms, c in r["profile"]["top_kernels"]]
        gaps = [{"name": n, "ms": ms, "count": c} for n, ms, c in r["profile"]["top_gaps"]]
        columns = [("name", "name", ""), ("ms/step", "ms", ".3f"), ("per step", "count", ".1f")]
        parts += [report.table(top, columns, f"bs {r['batch_size']}: top kernels")]
        parts += [report.table(gaps, columns, f"bs {r['batch_size']}: top idle gaps (between)")] if gaps else []
        parts += [report.table(r["per_layer"], LAYER_COLUMNS, f"bs {r['batch_size']}: kernels by group, per layer "
                               "(floor: bs 1's bytes of the group at the copy bandwidth)")]
    return "\n\n".join(parts)


def moe_table(engine: Engine) -> dict | None:
    """The moe_triton launch table the engine's MoE backend reads: its file ("" for none: the rule of
    thumb), whether tuned, its entries; None for another backend."""
    table = getattr(engine.runner.model_ctx.moe_backend, "table", None)
    return None if table is None else {"source": table.source, "tuned": table.tuned, "entries": len(table)}


# -- the run ----------------------------------------------------------------------------------------
def run(ns: argparse.Namespace, engine: Engine, payload: dict, device: torch.device) -> list[dict]:
    """Every batch size in turn, the result file rewritten after each (a run cut short keeps them)."""
    tb_s, model = payload["copy_tb_s"], engine.runner.model
    print(f"engine started in {payload['engine_start_s']:.0f} s", flush=True)
    payload.update(floor=floor(ns, model, tb_s), backends=engine.runner.backends_summary(),
                   moe_table=moe_table(engine), memory_after_engine=memory_gb(device))
    rows = payload["rows"]
    for bs in ns.batch_sizes:
        rows.append(measure(ns, engine, bs, device))
        rows[-1]["floor_ms"] = payload["floor"]["floor_ms"] if bs == 1 else None  # the floor is bs 1's
        if bs in ns.profile:
            rows[-1]["profile"] = steps.profile_step(engine, bs, ns.prompt, every_kernel=True)
            group_bytes = payload["floor"]["group_bytes"] if bs == 1 else None
            rows[-1]["per_layer"] = per_layer(rows[-1]["profile"], model.num_layers, group_bytes, tb_s)
        report.add_ratios(rows[-1:], {"ratio": ("engine_ms", "peer_ms"), "step_floor": ("engine_ms", "floor_ms"),
                                      "replay_floor": ("replay_ms", "floor_ms")})
        payload.update(memory=memory_gb(device), verdicts=verdicts(rows))
        report.write_result("moe-decode", result_subject(ns), payload, ns.out, ns.device)
    return rows


def result_subject(ns: argparse.Namespace) -> str:
    """The result file's subject: the model, any --custom-ops, --moe-configs and --no-one-token-layout (two
    runs of one call keep apart)."""
    configs = [f"configs-{Path(ns.moe_configs).stem}"] if ns.moe_configs else []
    sorted_ = ["sorted-one-token"] if ns.no_one_token_layout else []
    return "-".join([ns.model, *(op.replace("=", "-") for op in ns.custom_ops), *configs, *sorted_])


def verdicts(rows: list[dict]) -> dict:
    """Each target's verdict: engine / peer <= 1.0 at every batch size, the bs-1 step <= 1.6 x its floor."""
    out = {f"ratio_bs{r['batch_size']}": report.verdict(r["ratio"], TARGET_RATIO) for r in rows}
    bs1 = next((r for r in rows if r["batch_size"] == 1), {})
    out["step_floor_bs1"] = report.verdict(bs1.get("step_floor"), TARGET_FLOOR)
    out["checks"] = "MISMATCH" if any(r["check_result"]["mismatch"] for r in rows) else "ok"
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ns = parse_args(argv)
    device = torch.device(ns.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.moe_decode: --device cuda but no CUDA GPU (--device cpu --model tiny runs the code path)")
    tb_s = copy_tb_s(device)
    print(f"device copy bandwidth {tb_s:.2f} TB/s (the floor's)", flush=True)
    payload = {"args": vars(ns), "config": MODELS[ns.model], "copy_tb_s": tb_s, "rows": []}
    with tempfile.TemporaryDirectory(prefix="moe-decode-") as folder:
        (Path(folder) / "config.json").write_text(json.dumps(MODELS[ns.model]))
        began = time.perf_counter()
        rows = steps.with_engine(engine_settings(ns, Path(folder)), lambda engine: run(
            ns, engine, payload | {"engine_start_s": time.perf_counter() - began}, device))
    title = (f"{ns.model}: decode step, engine (whole generate loop) against the gpt-fast-style peer, "
             f"prompt {ns.prompt}, {ns.steps} steps, median of {ns.rounds}; floor: bs-1 active weights + KV "
             f"at {tb_s:.2f} TB/s; targets engine/peer <= {TARGET_RATIO}, step/floor <= {TARGET_FLOOR}")
    if ns.profile:
        print(profile_tables(rows) + "\n")
    print("verdicts: " + ", ".join(f"{k} {v}" for k, v in verdicts(rows).items()))
    print(report.table(rows, COLUMNS, title))
    return rows


if __name__ == "__main__":
    sys.exit(1 if any(r["check_result"]["mismatch"] for r in main()) else 0)
