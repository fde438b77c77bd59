"""The "triton" MoE backend's kernels under TRITON_INTERPRET=1 (fp32, fp16) against a plain per-token
reference: the expert-sorted layout, the whole apply across top-k, expert counts, uneven routing,
empty experts, token counts, launch configurations and chunking; buffers reused with new routing as
a graph replay reuses them; one-line errors; the config table."""

from __future__ import annotations

import json
import os
import types

import pytest
import torch

from backplane.contracts.moe import MoeBackendContext, MoeLayerInfo
from backplane.testing import moe_conformance

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the CPU run of Triton needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
pytest.importorskip("triton")

from backplane.plugins.moe_triton import align, configs  # noqa: E402
from backplane.plugins.moe_triton.backend import TritonMoeBackend  # noqa: E402
from backplane.plugins.moe_triton.configs import Config, ConfigTable  # noqa: E402
from backplane.plugins.moe_triton.gemm import Launch  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 2e-2}
# odd sizes: H not a multiple of any block_k, I not a multiple of any block_n
HIDDEN, INTER = 48, 40


def reference(x, w13, w2, weights, ids) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * w2[e] @ (silu(gate_e x[t]) * up_e x[t]), e = ids[t, j]; float64."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e].double() @ x[t].double()
            out[t] += float(weights[t, j]) * (w2[e].double() @ (torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]))
    return out


def make_layer(num_experts, gen, hidden=HIDDEN, inter=INTER, dtype=torch.float32):
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return types.SimpleNamespace(w13_weight=w13.to(dtype), w2_weight=w2.to(dtype))


def routing(num_tokens, top_k, num_experts, gen, kind="random"):
    """(weights [T, k] fp32, ids [T, k] int32). random: distinct experts per token by random logits;
    one: every token's first choice is expert 1 (the others follow it); ends: only experts 0 and E-1
    (k <= 2)."""
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), -1)
    if kind == "random":
        ids = torch.randn(num_tokens, num_experts, generator=gen).topk(top_k, -1).indices
    elif kind == "one":
        ids = (1 + torch.arange(top_k)).remainder(num_experts).expand(num_tokens, top_k)
    else:
        ids = torch.tensor([0, num_experts - 1][:top_k]).expand(num_tokens, top_k)
    return weights, ids.to(torch.int32).contiguous()


def make_backend(max_num_tokens=64, dtype=torch.float32, config=None):
    ctx = MoeBackendContext(dtype=dtype, device=torch.device("cpu"), max_num_tokens=max_num_tokens)
    return TritonMoeBackend(ctx, config)


def run_and_check(backend, layer, num_tokens, top_k, num_experts, gen, kind="random", dtype=torch.float32):
    x = torch.randn(num_tokens, layer.w13_weight.shape[2], generator=gen).to(dtype)
    weights, ids = routing(num_tokens, top_k, num_experts, gen, kind)
    out = backend.apply(layer, x, weights, ids)
    assert out.shape == x.shape and out.dtype == dtype
    want = reference(x, layer.w13_weight, layer.w2_weight, weights, ids)
    torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


# ---- the layout ------------------------------------------------------------------------------
def layout_reference(ids: torch.Tensor, num_experts: int, block_m: int):
    """(sorted pair numbers of each expert's run, padded run lengths) in expert order."""
    flat = ids.reshape(-1)
    runs = [torch.nonzero(flat == e).flatten().to(torch.int32) for e in range(num_experts)]
    return runs, [-(-len(r) // block_m) * block_m for r in runs]


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m", [
    (1, 1, 4, 16), (3, 2, 8, 16), (64, 8, 64, 16), (17, 8, 64, 32),
    (200, 8, 8, 64),  # 1600 pairs: the three-launch path
    (130, 8, 128, 16),  # 1040 pairs over many experts: three launches, chunks of 256
])  # fmt: skip
def test_align_layout(num_tokens, top_k, num_experts, block_m):
    gen = torch.Generator().manual_seed(num_tokens)
    _, ids = routing(num_tokens, top_k, num_experts, gen)
    num_pairs = ids.numel()
    rows = align.max_padded_rows(num_pairs, num_experts, block_m)
    sorted_ids = torch.full((rows,), -7, dtype=torch.int32)
    expert_ids = torch.full((rows // block_m,), -7, dtype=torch.int32)
    num_post = torch.zeros(1, dtype=torch.int32)
    chunk_counts = torch.zeros(align.num_chunks(num_pairs, num_experts) * 128, dtype=torch.int32)
    num_blocks = align.align(ids, num_experts, block_m, sorted_ids, expert_ids, num_post, chunk_counts)
    assert num_blocks == rows // block_m
    runs, padded = layout_reference(ids, num_experts, block_m)
    assert int(num_post) == sum(padded)
    start = 0
    for e, (run, length) in enumerate(zip(runs, padded)):
        assert torch.equal(sorted_ids[start:start + len(run)], run), f"expert {e}"
        assert (sorted_ids[start + len(run):start + length] == num_pairs).all(), f"expert {e}'s padding"
        assert (expert_ids[start // block_m:(start + length) // block_m] == e).all()
        start += length
    assert (expert_ids[start // block_m:] == -1).all()
    assert (sorted_ids[start:] == -7).all()  # rows past num_post_padded are left alone


def test_align_worst_case_fills_the_bound():
    """Every pair on its own expert: each takes a whole block, exactly max_padded_rows."""
    ids = torch.randperm(64, generator=torch.Generator().manual_seed(0)).to(torch.int32).view(16, 4)
    rows = align.max_padded_rows(64, 64, 16)
    buffers = (torch.empty(rows, dtype=torch.int32), torch.empty(rows // 16, dtype=torch.int32),
               torch.zeros(1, dtype=torch.int32), torch.empty(64, dtype=torch.int32))
    align.align(ids, 64, 16, *buffers)
    assert int(buffers[2]) == rows == 64 * 16
    assert torch.equal(buffers[1], torch.arange(64, dtype=torch.int32))  # block e holds expert e
    assert torch.equal(buffers[0][::16], ids.flatten().argsort().to(torch.int32))  # ... and its one pair


# ---- the whole backend -----------------------------------------------------------------------
@pytest.mark.parametrize("top_k,num_experts,token_counts", [(1, 4, (1, 64)), (2, 8, (3, 64)), (8, 64, (1, 17))])
def test_apply_against_reference(top_k, num_experts, token_counts):
    gen = torch.Generator().manual_seed(top_k * 100 + num_experts)
    layer, backend = make_layer(num_experts, gen), make_backend()
    for num_tokens in token_counts:
        run_and_check(backend, layer, num_tokens, top_k, num_experts, gen)


@pytest.mark.parametrize("kind,top_k", [("one", 1), ("one", 8), ("ends", 2)])
def test_uneven_routing_and_empty_experts(kind, top_k):
    """All tokens on one expert (a run of many blocks), or on the two end experts with the rest empty."""
    gen = torch.Generator().manual_seed(7)
    layer, backend = make_layer(16, gen), make_backend()
    for num_tokens in (1, 33):
        run_and_check(backend, layer, num_tokens, top_k, 16, gen, kind)


@pytest.mark.parametrize("block_m", configs.BLOCK_MS[:3])
def test_launch_configs(block_m):
    """Each block height with other tile sizes and L2 grouping; uneven K and N tails in both GEMMs."""
    gen = torch.Generator().manual_seed(block_m)
    launch = Launch(block_n=16, block_k=32, group_m=4, num_warps=4, num_stages=2)
    layer = make_layer(8, gen)
    backend = make_backend(config=Config(block_m, launch, Launch(block_n=32, block_k=16, group_m=2)))
    for num_tokens in (5, 40):
        run_and_check(backend, layer, num_tokens, 2, 8, gen)


def test_float16():
    gen = torch.Generator().manual_seed(16)
    layer = make_layer(8, gen, dtype=torch.float16)
    run_and_check(make_backend(dtype=torch.float16), layer, 9, 2, 8, gen, dtype=torch.float16)


def test_chunks_beyond_the_workspace_and_no_tokens():
    """T above max_num_tokens goes through in chunks of the workspace's size; T = 0 gives [0, H]."""
    gen = torch.Generator().manual_seed(3)
    layer, backend = make_layer(8, gen), make_backend(max_num_tokens=8)
    run_and_check(backend, layer, 21, 2, 8, gen)
    assert backend._workspaces[torch.float32].sizes.num_tokens == 8
    out = backend.apply(layer, torch.empty(0, HIDDEN), torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int32))
    assert out.shape == (0, HIDDEN)


def test_buffers_reused_with_new_routing():
    """What a graph replay does: the same workspace, the same T, another routing (and stale rows left
    by a larger call before), every result right; register_layer sizes the workspace once."""
    gen = torch.Generator().manual_seed(5)
    layer, backend = make_layer(8, gen), make_backend(max_num_tokens=32)
    info = MoeLayerInfo(layer_id=0, num_experts=8, top_k=2, hidden_size=HIDDEN, intermediate_size=INTER,
                        intermediate_size_per_partition=INTER, renormalize=True, params_dtype=torch.float32,
                        device=torch.device("cpu"))
    backend.register_layer(layer, info)
    workspace = backend._workspaces[torch.float32]
    for num_tokens, kind in ((32, "random"), (4, "random"), (4, "one"), (4, "ends")):
        run_and_check(backend, layer, num_tokens, 2, 8, gen, kind)
    assert backend._workspaces[torch.float32] is workspace


def test_one_token_takes_a_fixed_layout_without_the_sort(monkeypatch):
    """Decode at bs 1: the token's k experts are distinct, so no align launch; every block height, a
    layer whose top-k is below the workspace's (sentinels and unused blocks of the larger one), new
    routings through the same buffers (a graph replay), and int64 ids (those still take align)."""
    from backplane.plugins.moe_triton import backend as backend_module

    calls = []
    real_align = align.align
    monkeypatch.setattr(backend_module.align, "align", lambda *a, **k: calls.append(a[0].shape) or real_align(*a, **k))
    gen = torch.Generator().manual_seed(11)
    wide, narrow = make_layer(16, gen), make_layer(16, gen)
    for block_m in configs.BLOCK_MS:
        backend = make_backend(max_num_tokens=8, config=Config(block_m, Launch(block_n=16, block_k=32),
                                                               Launch(block_n=32, block_k=16)))
        run_and_check(backend, wide, 1, 8, 16, gen)  # the workspace is sized for top-k 8
        for kind in ("random", "one", "random"):
            run_and_check(backend, narrow, 1, 2, 16, gen, kind)
        sorted_ids, num_post = backend._workspaces[torch.float32].one_token[block_m]
        assert sorted_ids.shape == (8 * block_m,) and int(num_post) == 8 * block_m
        assert sorted_ids[::block_m].tolist() == list(range(8)) and set(sorted_ids.tolist()) - set(range(8)) == {8}
    assert calls == []
    backend = make_backend(max_num_tokens=8)
    x = torch.randn(1, HIDDEN, generator=gen)
    weights, ids = routing(1, 4, 16, gen)
    out = backend.apply(wide, x, weights, ids.long())
    torch.testing.assert_close(out.double(), reference(x, wide.w13_weight, wide.w2_weight, weights, ids), atol=1e-4, rtol=1e-4)
    run_and_check(backend, wide, 2, 4, 16, gen)
    assert calls == [(1, 4), (2, 4)]
    from backplane.plugins.moe_triton.options import TritonMoeOptions  # --no-triton-moe.one-token-layout: align again

    ctx = MoeBackendContext(torch.float32, torch.device("cpu"), 8, options=TritonMoeOptions(one_token_layout=False))
    run_and_check(TritonMoeBackend(ctx), wide, 1, 4, 16, gen)
    assert calls == [(1, 4), (2, 4), (1, 4)]


def test_bad_inputs_one_line():
    gen = torch.Generator().manual_seed(1)
    layer, backend = make_layer(4, gen), make_backend()
    weights, ids = routing(3, 2, 4, gen)
    with pytest.raises(ValueError, match=r"expected x \[T, H\].*got x \[3, 48, 1\]"):
        backend.apply(layer, torch.randn(3, HIDDEN, 1), weights, ids)
    with pytest.raises(ValueError, match=r"w2_weight \[E, H, I\] with H = 47"):
        backend.apply(layer, torch.randn(3, HIDDEN - 1), weights, ids)
    with pytest.raises(ValueError, match=r"expected int32 topk_ids.*float32"):
        backend.apply(layer, torch.randn(3, HIDDEN), weights, ids.float())
    with pytest.raises(ValueError, match="quantization 'int4' is not supported"):
        TritonMoeBackend(MoeBackendContext(torch.float32, torch.device("cpu"), 8, quant="int4"))


# ---- launch configurations -------------------------------------------------------------------
def test_default_config_grows_with_tokens_per_expert():
    blocks = [configs.default_config(t, 8, 128, torch.bfloat16).block_m for t in (1, 32, 128, 256, 512, 2048, 8192)]
    assert blocks == sorted(blocks) and blocks[0] == 16 and blocks[-1] == 128
    assert configs.default_config(1, 8, 128, torch.float32).gate_up.num_stages == 2


def table_json(entries):
    return {"device": "test", "tuned": True, "entries": entries}


def test_table_lookup_nearest_bucket():
    key = configs.shape_key(torch.bfloat16, 128, 768, 2048)
    small, big = configs.default_config(1, 8, 128, torch.bfloat16), configs.default_config(4096, 8, 128, torch.bfloat16)
    table = ConfigTable.from_json(table_json([configs.entry(key, 1, small), configs.entry(key, 64, big)]), "t.json")
    assert len(table) == 2 and table.tuned
    assert table.lookup(key, 1) == small and table.lookup(key, 7) == small and table.lookup(key, 8) == big
    assert table.lookup(key, 5000) == big
    assert table.lookup(configs.shape_key(torch.float16, 128, 768, 2048), 1) is None
    backend = make_backend()
    backend.table = table
    assert backend.launch_config(1, 8, 128, 768, 2048, torch.bfloat16) == small
    assert backend.launch_config(1, 8, 64, 768, 2048, torch.bfloat16) == configs.default_config(1, 8, 64, torch.bfloat16)


def test_table_errors_are_one_line(tmp_path):
    key = configs.shape_key(torch.bfloat16, 8, 64, 64)
    bad = configs.entry(key, 1, configs.default_config(1, 2, 8, torch.bfloat16))
    bad["gate_up"]["block_n"] = 24
    with pytest.raises(ValueError, match=r"entry 0: expected block_n and block_k powers of two"):
        ConfigTable.from_json(table_json([bad]), "t.json")
    with pytest.raises(ValueError, match=r"entry 0 lacks block_m"):
        ConfigTable.from_json(table_json([{k: v for k, v in bad.items() if k != "block_m"}]), "t.json")
    with pytest.raises(ValueError, match="does not exist"):
        configs.load_table(tmp_path / "missing.json")


def test_bundled_tables_parse():
    files = sorted(configs.CONFIG_DIR.glob("*.json"))
    assert files, "the plugin bundles a table per GPU"
    for path in files:
        table = configs.load_table(path)
        assert len(table) > 0 and json.loads(path.read_text())["device"].replace(" ", "_") + ".json" == path.name


# ---- backplane.testing.moe_conformance, interpreted ------------------------------------------
def triton_interpreted(ctx):
    """The backend as a bare factory: the suite takes it as a spec of the defaults (any platform)."""
    return TritonMoeBackend(ctx)


# NOTE: a subset, for the interpreter's sake: the suite's cases up to 32 tokens, 64 experts only at top-k 8
# (every case runs on the GPU in bf16: test_moe_triton_gpu.py)
CONFORMANCE_CASES = [c for c in moe_conformance.base_cases() if c.num_tokens <= 32 and not c.graph
                     and (c.num_experts < 64 or c.top_k == 8) and c.name not in ("experts-8-top-1", "experts-8-top-2")]
test_conformance = moe_conformance.make_suite(triton_interpreted, device="cpu", dtype=torch.float32,
                                              cases=CONFORMANCE_CASES, sizes=(48, 40))


@pytest.mark.parametrize("case", [c for c in moe_conformance.base_cases() if c.graph and c.num_tokens <= 32], ids=str)
def test_conformance_graph_cases_rerun(case):
    """The suite's graph cases with a re-run stand-in for the capture: static buffers refilled with new
    tokens and routings (the CUDA capture itself is the gpu test's)."""
    from backplane.executor.graph_runner import rerun_capture

    moe_conformance.check_graph(triton_interpreted, case, "cpu", torch.float32, sizes=(48, 40), capture=rerun_capture)
