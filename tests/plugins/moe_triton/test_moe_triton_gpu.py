"""The "triton" MoE backend compiled on CUDA: backplane.testing.moe_conformance in bf16 (graph cases
included), the Qwen3-30B-A3B layer against the reference at 1 to 2048 tokens, every block height in
three dtypes, the layout against its reference on the device, CUDA-graph replays with new routing
bit-equal to eager runs (two layers sharing the workspace), chunking, and torch.compile through the
opaque op. Run alone: `pytest -m gpu tests/plugins/moe_triton/test_moe_triton_gpu.py`."""

from __future__ import annotations

import os

import pytest
import torch

from backplane.contracts.moe import MoeBackendContext, MoeLayerInfo
from backplane.moe import moe_experts, moe_reference, route
from backplane.testing import moe_conformance

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(INTERPRETED, reason="TRITON_INTERPRET=1 is set: the kernels would run interpreted; run "
                                           "`pytest -m gpu tests/plugins/moe_triton/test_moe_triton_gpu.py`"),
]
pytest.importorskip("triton")

from backplane.plugins.moe_triton import align, configs  # noqa: E402
from backplane.plugins.moe_triton.backend import TritonMoeBackend  # noqa: E402
from backplane.plugins.moe_triton.configs import Config  # noqa: E402

QWEN3 = (128, 2048, 768, 8)  # E, H, I, k of Qwen3-30B-A3B

test_conformance = moe_conformance.make_suite("triton")


class Layer(moe_conformance.MoeLayer):
    """A MoE layer on the GPU with random weights (generated there: the Qwen3 shape is 1.2 GB)."""

    def __init__(self, backend, num_experts, hidden, inter, top_k, dtype=torch.bfloat16, seed=0):
        info = MoeLayerInfo(layer_id=seed, num_experts=num_experts, top_k=top_k, hidden_size=hidden,
                            intermediate_size=inter, intermediate_size_per_partition=inter, renormalize=True,
                            params_dtype=dtype, device=torch.device("cuda"))
        super().__init__(info, backend)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.load((torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).to(dtype),
                  (torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) / inter**0.5).to(dtype))
        backend.register_layer(self, info)
        backend.process_weights_after_loading(self)

    def inputs(self, num_tokens, kind="random", seed=1):
        """(x, topk_weights, topk_ids): random tokens; routing by route() over random logits, or every
        token on expert 3 first ("one"), or only the first k + 1 experts reachable ("few")."""
        gen = torch.Generator(device="cuda").manual_seed(seed)
        info = self.moe_info
        x = torch.randn(num_tokens, info.hidden_size, device="cuda", generator=gen).to(self.w13_weight.dtype)
        logits = torch.randn(num_tokens, info.num_experts, device="cuda", generator=gen)
        if kind == "one":
            logits[:, 3] += 100.0
        elif kind == "few":
            logits[:, info.top_k + 1:] = float("-inf")
        weights, ids = route(logits, info.top_k, True)
        return x, weights, ids

    def reference(self, x, weights, ids) -> torch.Tensor:
        """torch_native in fp32 on the GPU, as float64 on the CPU (what moe_conformance.compare takes)."""
        return moe_reference(x.float(), self.w13_weight.float(), self.w2_weight.float(), weights, ids).double().cpu()


def backend(max_num_tokens=2048, dtype=torch.bfloat16, config=None) -> TritonMoeBackend:
    return TritonMoeBackend(MoeBackendContext(dtype=dtype, device=torch.device("cuda"), max_num_tokens=max_num_tokens),
                            config)


@pytest.fixture(scope="module")
def qwen3_layer():
    return Layer(backend(), *QWEN3)


@pytest.mark.parametrize("num_tokens", [1, 8, 32, 257, 2048])
def test_qwen3_layer_against_reference(qwen3_layer, num_tokens):
    for kind in ("random", "one"):
        x, weights, ids = qwen3_layer.inputs(num_tokens, kind)
        got = qwen3_layer.ctx.moe_backend.apply(qwen3_layer, x, weights, ids)
        moe_conformance.compare(got, qwen3_layer.reference(x, weights, ids), torch.bfloat16,
                                f"qwen3 layer, {num_tokens} tokens, {kind} routing", weights, ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("block_m", configs.BLOCK_MS)
def test_every_block_height(block_m, dtype):
    """Each block height with the rule of thumb's launches for it; I = 352 leaves a tail in every
    column tiling, H = 520 in every K tiling of gate_up."""
    default = configs.default_config(4096, 8, 64, dtype)
    be = backend(512, dtype, Config(block_m, default.gate_up, default.down))
    layer = Layer(be, 64, 520, 352, 8, dtype)
    for num_tokens in (3, 300):
        x, weights, ids = layer.inputs(num_tokens)
        moe_conformance.compare(be.apply(layer, x, weights, ids), layer.reference(x, weights, ids), dtype,
                                f"block_m {block_m}, {num_tokens} tokens", weights, ids)


@pytest.mark.parametrize("num_tokens,num_experts,block_m", [(4, 128, 16), (1024, 128, 64), (700, 60, 32)])
def test_layout_on_device(num_tokens, num_experts, block_m):
    """The compiled align kernels (one program; three launches above SINGLE_PROGRAM_PAIRS) against
    the layout computed on the host."""
    ids = torch.randn(num_tokens, num_experts, device="cuda").topk(8, -1).indices.to(torch.int32)
    num_pairs = ids.numel()
    rows = align.max_padded_rows(num_pairs, num_experts, block_m)
    buffers = (torch.full((rows,), -7, dtype=torch.int32, device="cuda"),
               torch.full((rows // block_m,), -7, dtype=torch.int32, device="cuda"),
               torch.zeros(1, dtype=torch.int32, device="cuda"),
               torch.zeros(align.num_chunks(num_pairs, num_experts) * 128, dtype=torch.int32, device="cuda"))
    align.align(ids, num_experts, block_m, *buffers)
    sorted_ids, expert_ids, num_post = (b.cpu() for b in buffers[:3])
    flat, start = ids.flatten().cpu(), 0
    for e in range(num_experts):
        run = torch.nonzero(flat == e).flatten().to(torch.int32)
        length = -(-len(run) // block_m) * block_m
        assert torch.equal(sorted_ids[start:start + len(run)], run), f"expert {e}"
        assert (sorted_ids[start + len(run):start + length] == num_pairs).all()
        assert (expert_ids[start // block_m:(start + length) // block_m] == e).all()
        start += length
    assert int(num_post) == start and (expert_ids[start // block_m:] == -1).all()


@pytest.mark.parametrize("num_tokens", [1, 16, 256])
def test_graph_replay_equals_eager(num_tokens):
    """Two layers sharing one backend (and its workspace) captured in one CUDA graph at T tokens;
    replays with other tokens and routings equal eager runs bit for bit, and the reference."""
    be = backend(256)
    layers = [Layer(be, 128, 1024, 384, 8, seed=s) for s in (0, 1)]
    static = list(layers[0].inputs(num_tokens))

    def forward():
        hidden = be.apply(layers[0], *static)
        return be.apply(layers[1], hidden, static[1], static[2])

    forward()  # warm-up: kernels compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = forward()
    for seed, kind in enumerate(("random", "one", "few"), start=2):
        inputs = layers[0].inputs(num_tokens, kind, seed)
        for buffer, value in zip(static, inputs):
            buffer.copy_(value)
        graph.replay()
        replayed = static_out.clone()
        eager = be.apply(layers[1], be.apply(layers[0], *inputs), *inputs[1:])
        assert torch.equal(replayed, eager), f"replay with {kind} routing differs from eager"
        want = layers[1].reference(be.apply(layers[0], *inputs), *inputs[1:])
        moe_conformance.compare(replayed, want, torch.bfloat16, f"replay, {kind} routing", *inputs[1:])


def test_chunks_past_the_workspace(qwen3_layer):
    """2048 tokens through a workspace of 256: eight chunks, each right."""
    be = backend(256)
    x, weights, ids = qwen3_layer.inputs(2048, seed=7)
    got = be.apply(qwen3_layer, x, weights, ids)
    assert be._workspaces[torch.bfloat16].sizes.num_tokens == 256
    moe_conformance.compare(got, qwen3_layer.reference(x, weights, ids), torch.bfloat16, "chunked 2048", weights, ids)


def test_under_torch_compile(qwen3_layer):
    """moe_experts compiled (fullgraph) with work around it: the backend runs inside the opaque op,
    equal to the eager call."""

    def block(x, weights, ids):
        return moe_experts(qwen3_layer, x * 1.5, weights, ids) + x

    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    for num_tokens in (1, 64):
        inputs = qwen3_layer.inputs(num_tokens, seed=num_tokens)
        torch.testing.assert_close(compiled(*inputs), block(*inputs), atol=1e-2, rtol=1e-2)
