"""The extend-graph cases of the graph conformance suite on CPU: the triton backend's full EXTEND
capture (interpreted, fp32, `rerun_capture`) and a piecewise torch_native pass them; backends
whose replay metadata keeps stale lengths, or whose planning is reused per captured shape, fail."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from backplane import AttentionBackendSpec
from backplane.attention.torch_native import TorchNativeAttnBackend
from backplane.testing import attention_conformance
from backplane.testing.attention_conformance import EXTEND_GRAPH_CASES
from backplane.testing.graph_conformance import check_extend_graph_replay, extend_keys, shape_for

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                                       reason="the CPU run of Triton needs TRITON_INTERPRET=1 (and no GPU)")
# Small ladders: buckets 8, 16, 32 of 1, 2, 4 requests (9 keys), two replays each.
SMALL = dict(max_tokens=32, max_requests=4, replays_per_key=2, num_heads=4)


@needs_interpreter
@pytest.mark.parametrize("case", list(EXTEND_GRAPH_CASES))
def test_triton_extend_graphs_pass_the_suite(case):
    """Through make_graph_suite, as a plugin's own test module would run it (gpu cases aside)."""
    suite = attention_conformance.make_graph_suite("triton", device="cpu", dtype=torch.float32)
    suite(case)


@pytest.mark.parametrize("case", list(EXTEND_GRAPH_CASES))
def test_torch_native_piecewise_extend_passes_the_suite(case):
    """torch_native declares extend piecewise: the suite runs it eagerly on the padded batches."""
    attention_conformance.make_graph_suite("torch_native", device="cpu")(case)


def test_cases_a_backend_does_not_declare_are_skipped():
    from backplane.testing.attention_conformance import _extend_graph_case

    plain = AttentionBackendSpec(name="plain", factory=TorchNativeAttnBackend, description="no extend graphs")
    with pytest.raises(pytest.skip.Exception, match="declares no extend graphs"):
        _extend_graph_case(plain, "plain", "extend", "cpu", torch.float32)
    no_window = _piecewise(TorchNativeAttnBackend, sliding_window=False)
    with pytest.raises(pytest.skip.Exception, match="sliding_window not declared"):
        _extend_graph_case(no_window, "mine", "extend-sliding-window", "cpu", torch.float32)


def _triton_spec(cls) -> AttentionBackendSpec:
    from backplane.plugin.manager import load_plugins

    spec = load_plugins().registry.specs("attention")["triton"]
    return replace(spec, name=cls.__name__, factory=cls)


def _triton_class():
    from backplane.plugins.attention_triton.backend import TritonAttnBackend

    return TritonAttnBackend


def _keeps_capture_values(field: str):
    """A triton backend wrong on purpose: after each replay's refresh, the metadata tensor `field`
    (what the graph reads) holds the capture batch's values again."""

    class KeepsCaptureValues(_triton_class()):
        def init_metadata_for_capture(self, key, batch):
            super().init_metadata_for_capture(key, batch)
            self.__dict__.setdefault("captured", {})[key] = getattr(self.forward_metadata, field).clone()

        def init_metadata_for_replay(self, key, batch):
            super().init_metadata_for_replay(key, batch)
            getattr(self.forward_metadata, field).copy_(self.captured[key])

    return KeepsCaptureValues


@needs_interpreter
def test_stale_prefix_lengths_fail():
    """The capture batch's prefix lengths (all 0) where the graph reads them."""
    with pytest.raises(AssertionError, match=r"full extend graph \d+ requests x \d+ tokens replaying .* prefix"):
        check_extend_graph_replay(_triton_spec(_keeps_capture_values("prefix_lens")), torch.float32, "cpu", **SMALL)


@needs_interpreter
def test_stale_extend_lengths_fail():
    """The query offsets of the capture batch kept at replay."""
    with pytest.raises(AssertionError, match="full extend graph"):
        check_extend_graph_replay(_triton_spec(_keeps_capture_values("qo_indptr")), torch.float32, "cpu", **SMALL)


class PlansOncePerShape(TorchNativeAttnBackend):
    """Wrong on purpose, for piecewise replay: plans once per (requests, tokens) and reuses the
    plan, so every replay of a padded key attends with the first batch's lengths."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.cache = {}

    def init_forward_metadata(self, batch):
        shape = (batch.batch_size, batch.num_tokens)
        if shape not in self.cache:
            super().init_forward_metadata(batch)
            self.cache[shape] = self._plans
        self._plans, self._planned_for = self.cache[shape], batch


def _piecewise(cls, **declared) -> AttentionBackendSpec:
    flags = {"sliding_window": True, "logit_softcap": True, **declared}
    return AttentionBackendSpec(name=cls.__name__, factory=cls, description="piecewise extend graphs",
                                piecewise_graph_modes=("extend",), **flags)


def test_piecewise_planning_reused_per_shape_fails():
    with pytest.raises(AssertionError, match="piecewise extend graph"):
        check_extend_graph_replay(_piecewise(PlansOncePerShape), torch.float32, "cpu", **SMALL)


def test_pad_writes_outside_the_dump_slot_fail():
    """A backend that writes the padded tokens' K/V at the slot after each real one is caught by the pool check."""

    class SpillsPadding(TorchNativeAttnBackend):
        def forward_extend(self, q, k, v, layer, batch):
            out = super().forward_extend(q, k, v, layer, batch)
            loc = batch.out_cache_loc.clone()
            loc[loc == 0] = 1  # padded tokens into slot 1, a real request's slot
            batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, loc, k, v)
            return out

    with pytest.raises(AssertionError, match="dump slot 0"):
        check_extend_graph_replay(_piecewise(SpillsPadding), torch.float32, "cpu", **SMALL)


def test_every_key_is_reached():
    """shape_for finds, for every key of the ladders, batches that extend_shape pads into it."""
    import random

    from backplane.executor.graph_sizes import extend_batch_sizes, extend_shape, extend_token_buckets

    buckets, sizes = extend_token_buckets(96), extend_batch_sizes(8)
    rng = random.Random(0)
    for key in extend_keys(buckets, sizes):
        shapes = {shape_for(key, buckets, sizes, rng) for _ in range(20)}
        assert all(extend_shape(n, bs, buckets, sizes) == (key.batch_size, key.token_bucket) for bs, n in shapes)
        # a one-slot key has no room for a padded request: only the exact fit replays it
        assert key.batch_size == 1 or any(n < key.token_bucket for _, n in shapes)
