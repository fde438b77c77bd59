"""Overlap scheduling under tensor parallelism (CPU, gloo, world size 2).

Rank 0 must build every message to the workers from host data: `host_only_messages` makes it pack
a shadow of each batch whose device tensors sit on the meta device, where reading a value raises,
so a device-to-host copy coming back on the message path fails these tests. Decode messages carry
the placeholders of tokens still in flight, and the outputs equal --disable-overlap-schedule's
for greedy and seeded sampling (with and without LoRA), with both of rank 0's pools back where
they started.
"""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.distributed import driver
from backplane.distributed.batch_sync import BatchMessage, pack_batch
from backplane.contracts.batch import ForwardBatch, ForwardMode
from helpers_models import unused_slots
from lora_helpers import make_lora_world

CPU = dict(device="cpu", dtype="float32")
SYSTEM = list(range(3, 33))  # a shared prefix: later requests find it in rank 0's radix cache
PROMPTS = [SYSTEM + [40, 41], SYSTEM + [50], list(range(60, 105)), [7, 8, 9], SYSTEM + [70, 71, 72], [11]]
# A tight pool, small chunks and four running requests: chunked prefill, prefix hits and preemption.
TIGHT = dict(model="tiny-llama", max_total_tokens=100, chunked_prefill_size=16, max_running_requests=4, seed=7,
             **CPU)


def meta_shadow(batch: ForwardBatch) -> ForwardBatch:
    """`batch` with every device tensor, and the request pool's req_to_token, on the meta device
    (reading a meta tensor's values raises); host copies (`host`, `*_cpu`) stay as they are."""
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor) and not name.endswith("_cpu"):
            fields[name] = value.to("meta")
    fields["req_to_token_pool"] = SimpleNamespace(req_to_token=batch.req_to_token_pool.req_to_token.to("meta"))
    fields["token_to_kv_pool"] = None
    return ForwardBatch(**fields)


def check_message(msg: BatchMessage, batch: ForwardBatch) -> None:
    """The host message says what the device batch holds (read here, after packing: CPU test)."""
    assert torch.equal(msg.positions, batch.positions.cpu())
    assert torch.equal(msg.out_cache_loc, batch.out_cache_loc.cpu())
    assert torch.equal(msg.req_pool_indices, batch.req_pool_indices.cpu())
    known = msg.input_ids >= 0
    assert torch.equal(msg.input_ids[known], batch.input_ids.cpu()[known])
    assert msg.ids_follow == bool((~known).any())
    for t in (msg.input_ids, msg.positions, msg.out_cache_loc, msg.req_pool_indices):
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), "a view pickles its whole base"
    prefix = batch.extend_prefix_lens_cpu
    if batch.forward_mode == ForwardMode.DECODE and msg.prefix_slots is not None:
        prefix = batch.seq_lens_cpu - 1  # a prefill of one token each, run as DECODE: its cached prefixes
        assert int(prefix.sum()) and not msg.ids_follow  # (never a decode step's: those carry none)
    if prefix is not None and int(prefix.sum()):
        r2t = batch.req_to_token_pool.req_to_token
        rows = batch.req_pool_indices.tolist()
        expected = torch.cat([r2t[row, :n].long() for row, n in zip(rows, prefix.tolist())])
        assert torch.equal(msg.prefix_slots, expected)
    else:
        assert msg.prefix_slots is None


@pytest.fixture
def host_only_messages(monkeypatch):
    """Rank 0 packs each message (its LoRA segments included, host data in plugin_inputs) from
    `meta_shadow(batch)`; returns the messages sent, each checked against its batch."""
    sent: list[BatchMessage] = []
    real_pack = driver.pack_batch

    def pack(batch, **options):
        msg = real_pack(meta_shadow(batch), **options)
        check_message(msg, batch)
        sent.append(msg)
        return msg

    monkeypatch.setattr(driver, "pack_batch", pack)
    return sent


def mixed_params() -> list[SamplingParams]:
    """Greedy and seeded requests; stops mid-batch (a stop token, differing lengths)."""
    seeded = dict(temperature=0.9, top_p=0.9, ignore_eos=True)
    return [SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True),
            SamplingParams(max_new_tokens=9, seed=11, **seeded),
            SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, stop_token_ids=[0, 1, 2, 3]),
            SamplingParams(max_new_tokens=14, seed=5, top_k=20, **seeded),
            SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
            SamplingParams(max_new_tokens=10, seed=3, **seeded)]


def generate_tp2(overlap: bool, sent: list[BatchMessage], params, prompts=PROMPTS, lora=None, **settings):
    """Outputs of a tp-2 engine; its pools must end where they started."""
    engine = Engine(**settings, tp_size=2, disable_overlap_schedule=not overlap)
    try:
        assert engine.scheduler.overlap is overlap
        rows = engine.runner.req_to_token_pool
        start = (unused_slots(engine), rows.num_free)
        sent.clear()
        outs = engine.generate(input_ids=prompts, sampling_params=params, lora=lora)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        assert (unused_slots(engine), rows.num_free) == start, f"pools not back to their start (overlap {overlap})"
        assert not engine.scheduler.has_work
        return outs
    finally:
        engine.shutdown()


def assert_same(on, off):
    for i, (a, b) in enumerate(zip(on, off)):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), f"request {i}"
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5), f"request {i}"


def test_tp2_overlap_equals_no_overlap_greedy_and_seeded(host_only_messages, caplog):
    caplog.set_level(logging.INFO, logger="backplane.scheduler.scheduler")
    on = generate_tp2(True, host_only_messages, mixed_params(), **TIGHT)
    follow = [m for m in host_only_messages if m.ids_follow]
    assert follow and all(m.mode == "decode" and int(m.input_ids.min()) < 0 for m in follow)
    assert any(m.prefix_slots is not None for m in host_only_messages)  # prefix hits and later chunks
    off = generate_tp2(False, host_only_messages, mixed_params(), **TIGHT)
    # Without overlap no placeholder is built; a decode step that reuses the last batch
    # (DecodeState) still takes its ids from the device (all marked -1), and they follow by broadcast.
    assert all(m.mode == "decode" and bool((m.input_ids == -1).all()) for m in host_only_messages if m.ids_follow)
    assert "preempting request" in caplog.text
    assert_same(on, off)
    assert [len(o.token_ids) for o in on if o.finish_reason == "length"] == [
        p.max_new_tokens for p, o in zip(mixed_params(), on) if o.finish_reason == "length"]


def test_tp2_overlap_with_lora_equals_no_overlap(host_only_messages, tmp_path_factory):
    """Mixed adapters with eviction (3 adapters, 2 slots): the LoRA table goes from host data too."""
    world = make_lora_world(tmp_path_factory.mktemp("tp_overlap_lora"))
    settings = dict(model=str(world.base_dir), max_total_tokens=1024, lora_paths=world.lora_paths(),
                    lora_backend="torch_native", max_loras_per_batch=2, **CPU)
    prompts, adapters = PROMPTS[:4], ["all7_r4", None, "qv_down_r8", "kogu_r2"]
    on = generate_tp2(True, host_only_messages, mixed_params()[:4], prompts, adapters, **settings)
    assert any(m.ids_follow and m.plugin_inputs.get("lora") is not None for m in host_only_messages)
    assert_same(on, generate_tp2(False, host_only_messages, mixed_params()[:4], prompts, adapters, **settings))


def test_tp2_overlap_equals_tp1_greedy():
    """tp 2 with overlap gives tp 1's greedy tokens (the dummy weights come from --seed)."""
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    tp1 = Engine(**TIGHT).generate(input_ids=PROMPTS, sampling_params=greedy)
    tp2 = generate_tp2(True, [], greedy, **TIGHT)
    assert [o.token_ids for o in tp2] == [o.token_ids for o in tp1]


def test_pack_batch_needs_the_builders_host_copies():
    batch = ForwardBatch(ForwardMode.DECODE, 1, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                         torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int32),
                         torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64), None, None)
    with pytest.raises(ValueError, match=r"expected a batch from the batch builder with host copies"):
        pack_batch(batch)
