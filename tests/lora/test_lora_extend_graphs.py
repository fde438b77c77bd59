"""LoRA in extend graphs (issue 38): the manager binds a ragged key's segments in the padded layout,
both LoRA backends compute a bucket of ragged segments from static buffers (the products against
the per-segment reference; the triton kernels launched with the same grid and arguments at capture
and at every replay), and an engine whose extend and decode forwards replay graphs generates what
the eager engine does for a mixed batch of adapters, base-only requests and a cached prefix.

On CPU the graphs are `rerun_capture` stand-ins (the captured Python re-runs at every replay) with
the triton attention backend and triton LoRA under TRITON_INTERPRET=1; the `gpu` tests capture real
CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.contracts.batch import ForwardBatch, ForwardMode
from backplane.contracts.graph import GraphKey
from backplane.executor.graph_runner import GraphRunner, capture_graph, pad_into, rerun_capture
from backplane.lora.manager import GRAPH_MODES, LORA
from backplane.plugin.manager import load_plugins
from backplane.testing.lora_conformance import Case, Problem, assert_close
from lora_helpers import make_lora_world

LORA_ON = ((LORA, True),)
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
# one call of four requests (two adapters, two base-only, different lengths: 20 tokens, bucket 32 with
# a padded request of 12), then an extend over the first prompt's cached prefix next to a new prompt
FIRST = ([[5, 17, 33, 2, 9], [7, 8, 9, 10, 11, 12, 13], [40, 41, 42], [5, 17, 33, 2, 9]],
         ["all7_r4", "qv_down_r8", None, None])
SECOND = ([[5, 17, 33, 2, 9, 60, 61, 62], [90, 91, 92, 93, 94, 95]], ["all7_r4", "kogu_r2"])


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_lora_world(tmp_path_factory.mktemp("lora-extend-graphs"), head_dim=32)  # triton attention: >= 32


def cpu_engine(world, backend: str) -> Engine:
    return Engine(str(world.base_dir), device="cpu", dtype="float32", attention_backend="triton",
                  max_total_tokens=512, max_running_requests=8, lora_paths=world.lora_paths(), lora_backend=backend,
                  max_loras_per_batch=3, cuda_graph_max_tokens=32, cuda_graph_max_extend_bs=5, cuda_graph_bs=[4])


def generate_both(engine) -> list[list[int]]:
    out = []
    for prompts, adapters in (FIRST, SECOND):
        out += [o.token_ids for o in engine.generate(None, GREEDY, input_ids=prompts, lora=adapters)]
    return out


# -- the manager's segments of a padded ragged key ----------------------------------------------------


@pytest.fixture(scope="module")
def native_engine(world):
    return cpu_engine(world, "torch_native")


def extend_batch(engine, new_lens: list[int], prefix_lens: list[int]) -> ForwardBatch:
    """A real extend batch (host lengths as the scheduler sets them) on the engine's pools."""
    runner = engine.runner
    n, bs = sum(new_lens), len(new_lens)
    positions = torch.cat([torch.arange(p, p + k) for p, k in zip(prefix_lens, new_lens)])
    seq_lens = torch.tensor([p + k for p, k in zip(prefix_lens, new_lens)], dtype=torch.int32)
    batch = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=bs, input_ids=torch.zeros(n, dtype=torch.int64),
                         positions=positions, req_pool_indices=torch.arange(bs), seq_lens=seq_lens,
                         seq_lens_cpu=seq_lens.clone(), out_cache_loc=torch.zeros(n, dtype=torch.int64),
                         req_to_token_pool=runner.req_to_token_pool, token_to_kv_pool=runner.token_to_kv_pool)
    batch.set_extend_lens(prefix_lens, new_lens)
    return batch


def segments(info) -> tuple[list[int], list[int]]:
    return info.seg_lens_cpu[: info.bs].tolist(), info.weight_indices_cpu[: info.bs].tolist()


def test_prepare_graph_batch_segments_of_a_padded_ragged_key(native_engine):
    manager = native_engine.lora_manager
    runner = GraphRunner(native_engine.runner.graph_context(), {ForwardMode.EXTEND: "full"}, [LORA_ON])
    key = runner.extend_key(5, 32, LORA_ON)
    # capture: the capture batch's lengths [T - (B - 1), 1, ...], every request base only
    bound = manager.prepare_graph_batch(runner._capture_batch(key), key)
    assert bound[LORA] is manager.graph_info
    assert segments(manager.graph_info) == ([28, 1, 1, 1, 1], [0] * 5)
    assert manager.graph_info.num_tokens == 32
    # replay: 3 real requests of 4, 7 (over a 6-token prefix) and 2 new tokens; the padded request
    # takes tokens 13..32 on slot 0, the last one none
    real = extend_batch(native_engine, [4, 7, 2], [0, 6, 0])
    manager.prepare_batch(real, [SimpleNamespace(lora=n) for n in ("all7_r4", None, "kogu_r2")])
    slots = list(real.plugin_inputs[LORA].slots)
    assert slots[1] == 0 and 0 not in (slots[0], slots[2])
    padded = pad_into(runner.static, real, key, runner.pad_row, runner.fill_for(key))
    bound = manager.prepare_graph_batch(padded, key, real=real)
    info = bound[LORA]
    assert info is manager.graph_info
    assert segments(info) == ([4, 7, 2, 19, 0], slots + [0, 0])
    assert info.num_tokens == key.num_tokens == 32
    want_slots = [slots[0]] * 4 + [0] * 7 + [slots[2]] * 2 + [0] * 19
    assert manager.graph_info.token_slots[:32].tolist() == want_slots
    # the eager info is untouched by the replay binding; a LoRA-off key binds nothing
    assert segments(manager.info) != segments(info)
    assert manager.prepare_graph_batch(padded, dataclasses.replace(key, extras=((LORA, False),)), real=real) == {LORA: None}
    # segments that do not cover the real batch's tokens would put deltas on the wrong rows
    bad = dataclasses.replace(real.plugin_inputs[LORA], seg_lens=(4, 6, 2))
    real.plugin_inputs[LORA] = bad
    with pytest.raises(ValueError, match=r"covering the batch's 13 tokens, got seg_lens \[4, 6, 2\]"):
        manager.prepare_graph_batch(padded, key, real=real)


def test_both_bundled_backends_declare_extend_and_the_manager_says_so(native_engine):
    specs = load_plugins().registry.specs("lora")
    for name in ("torch_native", "triton"):
        assert specs[name].supports_graph and "extend" in specs[name].graph_modes, name
    assert native_engine.lora_manager.graph_participant().graph_modes == GRAPH_MODES


def test_a_backend_declaring_only_uniform_modes_keeps_extend_eager(native_engine, monkeypatch):
    from backplane.executor.graph_sizes import capture_kinds
    from backplane.plugin.registry import LoraBackendSpec

    manager = native_engine.lora_manager
    bare = LoraBackendSpec(name="uniform", factory=object, description="t", supports_graph=True)
    assert bare.graph_modes == ("decode", "target_verify")
    monkeypatch.setattr(manager, "selection", dataclasses.replace(manager.selection, spec=bare))
    part = manager.graph_participant()
    assert part.graph_modes == ("decode", "target_verify")
    kinds, limits = capture_kinds(["decode", "extend"], [part])
    assert kinds == {"decode": "full"} and limits[0].mode == "extend" and "'uniform'" in limits[0].item
    eager = dataclasses.replace(bare, graph_modes=("decode", "target_verify", "extend"), supports_graph=False)
    monkeypatch.setattr(manager, "selection", dataclasses.replace(manager.selection, spec=eager))
    assert manager.graph_participant().graph_modes == ()  # graph_modes counts only with supports_graph


# -- the backends: a bucket of ragged segments from static buffers ------------------------------------


class Launches:
    """Records the triton LoRA kernels' launches: host values as they are, tensors by shape and
    dtype, and by address when they live in a static buffer (the tile plan, the graph batch info):
    what a captured graph would replay with."""

    def __init__(self, monkeypatch, static: Callable[[], list[torch.Tensor]]):
        from backplane.plugins.lora_triton import folded, fused, kernels

        self.static = static  # the static buffers, asked at each launch
        self.calls: list[tuple] = []
        for module, name in ((kernels, "shrink"), (kernels, "expand"), (fused, "fused_shrink_expand"),
                             (folded, "folded_expand")):
            original = getattr(module, name)
            monkeypatch.setattr(module, name, self._recorder(name, original))

    def _recorder(self, name, original):
        def record(*args, **kwargs):
            self.calls.append((name, tuple(map(self.describe, args)),
                               tuple((k, self.describe(v)) for k, v in sorted(kwargs.items()))))
            return original(*args, **kwargs)

        return record

    def describe(self, value):
        if isinstance(value, torch.Tensor):
            ptr = value.untyped_storage().data_ptr()
            static = any(ptr == t.untyped_storage().data_ptr() for t in self.static())
            return ("tensor", tuple(value.shape), value.dtype, value.data_ptr() if static else None)
        if dataclasses.is_dataclass(value):  # FusedBuffers, FusedConfig
            return (type(value).__name__,) + tuple(self.describe(getattr(value, f.name))
                                                   for f in dataclasses.fields(value))
        if isinstance(value, (list, tuple)):
            return tuple(map(self.describe, value))
        return value

    def take(self) -> list[tuple]:
        calls, self.calls = self.calls, []
        return calls


def pad_segments(seg_lens: list[int], slots: list[int], batch_size: int, bucket: int) -> tuple[list[int], list[int]]:
    """What the manager binds for a ragged key: the real segments, then a padded request on slot 0
    with the bucket's spare tokens, then empty ones."""
    spare = bucket - sum(seg_lens)
    pad = batch_size - len(seg_lens)
    assert pad >= 1 or spare == 0
    return seg_lens + ([spare] + [0] * (pad - 1) if pad else []), slots + [0] * pad


RAGGED = [  # (name, projection, path, bucket, request slots, real batches: (seg_lens, slots))
    ("segmented-qkv", "qkv", "split", 96, 5, [([40, 1, 17, 9], [1, 0, 2, 3]), ([3, 60, 2], [3, 3, 0])]),
    ("segmented-gate-up", "gate_up", "split", 96, 4, [([70, 5], [2, 4]), ([1, 1, 94], [4, 1, 1])]),
    ("fused-qkv", "qkv", "fused", 32, 5, [([9, 1, 12, 2], [1, 0, 4, 1]), ([20, 5], [3, 2])]),
    ("folded-gate-up", "gate_up", "folded", 32, 4, [([4, 11, 6], [2, 0, 3]), ([31], [1])]),
    ("folded-single", "single", "folded", 16, 3, [([15], [4]), ([2, 3], [1, 2])]),
]


def check_ragged_graph(backend_name: str, spec_row, device: str, dtype: torch.dtype, monkeypatch):
    """Capture a ragged key (every segment on slot 0, lengths [T - (B - 1), 1, ...]), then replay it
    with real batches of other lengths and adapters, padded as the manager pads them; each replay
    equals the per-segment reference, and the triton kernels run with the capture's launches."""
    name, projection, path, bucket, batch_size, reals = spec_row
    spec = load_plugins().registry.specs("lora")[backend_name]
    case = Case(f"ragged-{name}", tuple(reals[0][0]), tuple(reals[0][1]), projection, graph=True,
                fused=path == "fused", folded=path == "folded")
    problem = Problem(case, dtype, device, seed=3)
    backend = spec.factory(problem.context(batch_size, bucket))
    if backend_name == "triton":  # the fused kernel only with decode_path fused; the split path at any T
        backend.folds_shrink = path == "folded"
        if path == "split":
            backend.tuning = dataclasses.replace(backend.tuning, fused_max_tokens=0)
    backend.init_graph_state(batch_size, bucket)
    capture_lens = [bucket - (batch_size - 1)] + [1] * (batch_size - 1)
    info = problem.info(capture_lens, [0] * batch_size, batch_size)
    key = GraphKey(ForwardMode.EXTEND, batch_size, 0, LORA_ON, token_bucket=bucket)
    backend.init_metadata_for_capture(key, info)
    static_x, static_base = problem.inputs(bucket)
    static_out = static_base.clone()
    plan = getattr(backend, "_plan", None)
    static = [info.seg_lens, info.ranks, info.scalings] + ([plan.tiles, plan.locks] if plan is not None else [])
    launches = Launches(monkeypatch, lambda: static)

    def body() -> None:
        static_out.copy_(static_base)
        problem.run(backend, static_x, static_out)

    if device == "cuda":
        replay = capture_graph(body, warmup=1)[0].replay
    else:
        body()
        replay = body
    captured = launches.take()
    if backend_name == "triton":
        assert {c[0] for c in captured} == {"split": {"shrink", "expand"}, "fused": {"fused_shrink_expand"},
                                            "folded": {"folded_expand"}}[path]
    for step, (seg_lens, slots) in enumerate(reals):
        padded_lens, padded_slots = pad_segments(seg_lens, slots, batch_size, bucket)
        x, base = problem.inputs(bucket)
        static_x.copy_(x)
        static_base.copy_(base)
        info.update_(padded_lens, padded_slots)
        backend.init_metadata_for_replay(key, info)
        replay()
        if device != "cuda":
            assert launches.take() == captured, f"{name}: replay {step} launched other kernels than the capture"
        assert_close(case, static_out, problem.reference(x, base, padded_lens, padded_slots), dtype, f"replay {step}")


@pytest.mark.parametrize("spec_row", RAGGED, ids=lambda r: r[0])
@pytest.mark.parametrize("backend_name", ["torch_native", "triton"])
def test_backend_replays_ragged_segments_from_static_buffers(backend_name, spec_row, monkeypatch):
    if backend_name == "triton" and not interpreted():
        pytest.skip("the CPU run of Triton needs TRITON_INTERPRET=1")
    if backend_name == "torch_native" and spec_row[2] != "split" and spec_row[0] != "folded-single":
        pytest.skip("torch_native has one path: the split rows and one folded row cover it")
    check_ragged_graph(backend_name, spec_row, "cpu", torch.float32, monkeypatch)


def test_torch_native_graph_keys_read_no_host_segments(monkeypatch):
    """Bound for a graph key, torch_native takes the per-slot masks (device buffers only) even
    outside a CUDA capture, so the CPU stand-in replays exercise what a real graph records."""
    from backplane.lora.torch_native import TorchNativeLoraBackend

    host_reads = []
    original = TorchNativeLoraBackend._segments
    monkeypatch.setattr(TorchNativeLoraBackend, "_segments", lambda self: (host_reads.append(1), original(self))[1])
    check_ragged_graph("torch_native", RAGGED[0], "cpu", torch.float32, monkeypatch)
    assert host_reads == []
    backend = TorchNativeLoraBackend(Problem(Case("c", (2,), (1,), "single"), torch.float32, "cpu", 0).context(2, 4))
    backend.prepare_batch(Problem(Case("c", (2,), (1,), "single"), torch.float32, "cpu", 0).info([2], [1], 2))
    assert not backend._use_slot_loop()  # an eager batch again: the per-segment reference


# -- the engine: extend and decode graphs generate what the eager engine does -------------------------


def graph_engine(engine, monkeypatch, static: Callable[[], list[torch.Tensor]] | None = None):
    """Attach a GraphRunner with extend and decode graphs (LoRA-on keys, the extend shapes the test
    uses; CPU stand-ins) and record the
    keys it replays, with the batches' prefix lengths, and, with `static`, the triton launches of each
    capture and replay."""
    runner = engine.runner
    graphs = GraphRunner(runner.graph_context(), {ForwardMode.EXTEND: "full", ForwardMode.DECODE: "full"}, [LORA_ON])
    graphs.capture_fn = rerun_capture
    # the shapes this test's batches take (the interpreter is slow): 4 requests of 20 tokens, 2 of 9
    graphs.extend_buckets, graphs.extend_sizes = [16, 32], [4, 5]
    launches = Launches(monkeypatch, static) if static is not None else None
    graphs.launches = {}  # key -> the launches of one run of its forward, at capture
    graphs.replayed = []
    capture_one, replay = graphs._capture_one, graphs.replay

    def capture_recorded(key):
        capture_one(key)
        if launches is not None:  # the stand-in warms up once, then runs the forward it keeps
            calls = launches.take()
            half = len(calls) // 2
            assert calls[:half] == calls[half:], f"{key}: the warm-up and the capture launched differently"
            graphs.launches[key] = calls[:half]

    def replay_recorded(batch, key=None):
        key = key or graphs.key_for(batch)
        prefix = batch.extend_prefix_lens_cpu.tolist() if key.ragged else None
        if launches is not None:
            launches.take()  # an eager forward's launches since the last replay
        out = replay(batch, key)
        if launches is not None:
            assert launches.take() == graphs.launches[key], f"{key}: a replay launched other kernels than the capture"
        graphs.replayed.append((key, prefix))
        return out

    monkeypatch.setattr(graphs, "_capture_one", capture_recorded)
    monkeypatch.setattr(graphs, "replay", replay_recorded)
    graphs.capture()
    runner.graph_runner = graphs
    engine.flush_cache()
    return graphs


def check_replayed(graphs) -> None:
    extend = [(key, prefix) for key, prefix in graphs.replayed if key.ragged]
    assert (GraphKey(ForwardMode.EXTEND, 5, 0, LORA_ON, token_bucket=32), [0, 0, 0, 0]) in extend
    assert any(any(prefix) for _, prefix in extend), extend  # an extend over the cached prefix
    assert any(key.mode is ForwardMode.DECODE for key, _ in graphs.replayed)


# The triton paths (segmented and folded) run in the backend-level ragged test above; in an engine each
# costs the CPU suite about 20 s under the interpreter, so in an engine triton runs on the GPU only
# (test_gpu_extend_graphs_generate_what_disable_extend_graph_does), and the CPU run keeps torch_native.
@pytest.mark.parametrize("variant", ["torch_native", pytest.param("triton-folded", marks=pytest.mark.gpu)])
def test_extend_graphs_generate_what_the_eager_engine_does(world, variant, monkeypatch):
    backend = variant.split("-")[0]
    if backend == "triton" and not interpreted():
        pytest.skip("the CPU run of Triton needs TRITON_INTERPRET=1")
    engine = cpu_engine(world, backend)
    manager = engine.lora_manager
    static = None
    if backend == "triton":
        lora = manager.backend
        if variant == "triton-segmented":  # extend buckets on the tile plan (as on a GPU above 64 tokens)
            lora.tuning = dataclasses.replace(lora.tuning, fused_max_tokens=8)  # decode (4 tokens) folds
        info = manager.graph_info

        def static():
            return [info.seg_lens, info.ranks, info.scalings, lora._plan.tiles, lora._plan.locks]
    want = generate_both(engine)
    assert want[0] != want[3], "the adapter changes nothing: the comparison would not see LoRA"
    graphs = graph_engine(engine, monkeypatch, static)
    assert generate_both(engine) == want
    check_replayed(graphs)
    if backend == "triton":  # which kernels the extend graphs recorded
        kernels = {call[0] for key, calls in graphs.launches.items() if key.ragged for call in calls}
        assert kernels == ({"shrink", "expand"} if variant == "triton-segmented" else {"folded_expand"})


# -- GPU: real CUDA graphs ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("spec_row", RAGGED, ids=lambda r: r[0])
@pytest.mark.parametrize("backend_name", ["torch_native", "triton"])
def test_gpu_backend_replays_ragged_segments_in_a_cuda_graph(backend_name, spec_row, monkeypatch):
    for dtype in (torch.float32, torch.bfloat16):
        check_ragged_graph(backend_name, spec_row, "cuda", dtype, monkeypatch)


GPU_PROMPTS = ([[5, 17, 33, 2, 9] * 7, list(range(40, 93)), [7], [101, 3, 250, 77, 4, 4], list(range(100, 190))],
               ["all7_r4", None, "qv_down_r8", "kogu_r2", "all7_r4"])


def gpu_generate(world, backend: str, extend_graphs: bool) -> tuple[list[list[int]], list[GraphKey]]:
    """Greedy tokens of a mixed batch, then of extends over cached prefixes, on a CUDA engine with
    LoRA; and the keys its graph runner replayed."""
    prompts, adapters = GPU_PROMPTS
    follow = [prompts[0] + [60, 61, 62, 63], prompts[1][:20] + [9] * 7]
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    engine = Engine(str(world.base_dir), device="cuda", dtype="float32", attention_backend="triton",
                    lora_paths=world.lora_paths(), lora_backend=backend, max_loras_per_batch=3,
                    max_running_requests=16, max_total_tokens=4096, cuda_graph_max_tokens=256,
                    cuda_graph_max_extend_bs=8, cuda_graph_bs=[1, 2, 4, 8], disable_extend_graph=not extend_graphs)
    try:
        graphs = engine.runner.graph_runner
        assert graphs is not None
        assert any(k.ragged and dict(k.extras)[LORA] for k in graphs.graphs) == extend_graphs
        replayed: list[GraphKey] = []
        replay = graphs.replay

        def replay_recorded(batch, key=None):
            replayed.append(key or graphs.key_for(batch))
            return replay(batch, key)

        graphs.replay = replay_recorded
        got = [o.token_ids for o in engine.generate(None, sampling, input_ids=prompts, lora=adapters)]
        got += [o.token_ids for o in engine.generate(None, sampling, input_ids=follow, lora=["all7_r4", None])]
        return got, replayed
    finally:
        engine.shutdown()
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_gpu_extend_graphs_generate_what_disable_extend_graph_does(tmp_path, backend):
    world = make_lora_world(tmp_path, head_dim=64)
    with_graphs, replayed = gpu_generate(world, backend, extend_graphs=True)
    assert any(k.ragged and dict(k.extras)[LORA] for k in replayed), replayed
    eager, _ = gpu_generate(world, backend, extend_graphs=False)
    assert with_graphs == eager
