"""bench/e2e.py --profile on CPU: the profiled run's steps split by kind agree with the steps the
engine ran (counted by spies on the scheduler and launcher classes), the split covers the run's wall
time, the floors per step add up to the workload's floor, the timed rows keep their keys; and on
made-up device events, the split a CUDA run gets (busy and idle time per step, kernels by the step
that launched them, record_function ranges' device copies left out)."""

from __future__ import annotations

import collections
import json
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList, FunctionEvent

from helpers_bench import CPU
from backplane import Engine
from backplane.scheduler.launcher import BatchLauncher
from backplane.scheduler.scheduler import Scheduler
from bench import e2e, timing


@pytest.fixture
def spies(monkeypatch):
    """Per Engine.generate call, in order: scheduler steps, forwards, prefill and decode tokens."""
    calls: list[collections.Counter] = []
    generate, step = Engine.generate, Scheduler.step
    prefill, decode = BatchLauncher.forward_prefill, BatchLauncher.decode

    def spy_generate(self, *args, **kwargs):
        calls.append(collections.Counter())
        return generate(self, *args, **kwargs)

    def spy_step(self):
        calls[-1]["steps"] += 1
        return step(self)

    def spy_prefill(self, reqs, chunks):
        calls[-1].update(forwards=1, prefills=1, prefill_tokens=sum(chunks))
        return prefill(self, reqs, chunks)

    def spy_decode(self, reqs):
        calls[-1].update(forwards=1, decodes=1, decode_tokens=len(reqs))
        return decode(self, reqs)

    monkeypatch.setattr(Engine, "generate", spy_generate)
    monkeypatch.setattr(Scheduler, "step", spy_step)
    monkeypatch.setattr(BatchLauncher, "forward_prefill", spy_prefill)
    monkeypatch.setattr(BatchLauncher, "decode", spy_decode)
    return calls


def test_the_profile_splits_the_run_into_the_steps_the_engine_ran(spies, tmp_path, capsys):
    # "fixed" last: the profiled run is the last generate of the main call
    rows = e2e.main(["--model", "tiny-llama", "--backends", "torch_native", "--workloads", "distinct", "fixed",
                     "--requests", "3", "--fixed-shape", "16", "4", "--prefix-shape", "8", "8", "3", "--profile", "fixed",
                     "--out", str(tmp_path), *CPU])
    distinct, fixed = rows
    assert "profile" not in distinct and set(fixed) - {"profile"} == set(distinct)  # the timed rows keep their keys
    p, ran = fixed["profile"], spies[-1]
    kinds = p["kinds"]
    assert kinds["prefill"]["steps"] + kinds["decode"]["steps"] == ran["forwards"] > 0
    assert (kinds["prefill"]["steps"], kinds["decode"]["steps"], p["steps"]) == (ran["prefills"], ran["decodes"], ran["steps"])
    assert kinds["other"]["steps"] == ran["steps"] - ran["forwards"]
    assert (kinds["prefill"]["tokens"], kinds["decode"]["tokens"]) == (ran["prefill_tokens"], ran["decode_tokens"]) == (3 * 16, 3 * 3)
    assert p["whole_run"] and len(p["per_step"]["rows"]) == p["steps"]
    assert [r[0] for r in p["per_step"]["rows"]].count("decode") == ran["decodes"]
    for kind in ("prefill", "decode"):
        k = kinds[kind]
        assert 0 < k["launch_ms"] <= k["host_ms"] <= k["wall_ms"] and k["wait_ms"] >= 0
        assert k["device_busy_ms"] == 0 and k["device_idle_ms"] == pytest.approx(k["wall_ms"])  # CPU: no device events
        # the floor of the batches as they ran is the workload's floor: every step as floor_seconds counts it
        assert k["floor_ms"] == pytest.approx(p["workload_floor_ms"][kind], rel=1e-9)
        assert k["x_floor"] == pytest.approx(k["wall_ms"] / k["floor_ms"])
    steps_ms = sum(k["wall_ms"] for k in kinds.values())
    assert steps_ms == pytest.approx(p["steps_ms"]) and steps_ms == pytest.approx(p["wall_ms"], rel=0.15)
    assert sum(b["steps"] for b in p["decode_by_batch"].values()) == ran["decodes"]
    saved = json.loads(next(tmp_path.glob("e2e-tiny-llama-cpu-*.json")).read_text())
    assert saved["rows"][1]["profile"]["kinds"]["decode"]["steps"] == ran["decodes"]
    out = capsys.readouterr().out
    table = out[out.index("profiled runs by kind of step"):]
    assert out.index("profiled fixed torch_native") < out.index("profiled runs by kind of step")
    assert table.strip().splitlines()[-1].split()[:3] == ["fixed", "torch_native", "decode"]  # the table is last


def test_a_profile_of_another_workload_is_refused():
    with pytest.raises(SystemExit):
        e2e.parse_args(["--workloads", "fixed", "--profile", "sharegpt-like"])


class FakeLauncher:
    def forward_prefill(self, reqs, chunks):
        return "logits"

    def decode(self, reqs):
        return "launched"


class FakeScheduler:
    def __init__(self, plan):
        self.launcher, self.plan = FakeLauncher(), plan

    def step(self):
        kind = self.plan.pop(0)
        if kind == "prefill":
            self.launcher.forward_prefill([SimpleNamespace(num_cached=0)] * 2, [5, 7])
        elif kind == "decode":
            self.launcher.decode([SimpleNamespace(num_cached=9), SimpleNamespace(num_cached=19)])
        return []


def test_step_tags_record_kinds_and_floors_stop_after_the_limit_and_restore():
    scheduler, stops = FakeScheduler(["prefill", "decode", "other", "decode"]), []
    sizes = {"weights": 1000, "kv_per_token": 10, "matmul_params": 50, "tb_s": 1e-12}
    tags = e2e.StepTags(SimpleNamespace(scheduler=scheduler), sizes, limit=3, stop=lambda: stops.append(len(scheduler.plan)))
    for _ in range(4):
        scheduler.step()
    assert [s["kind"] for s in tags.steps] == ["prefill", "decode", "other"] and stops == [1]  # stopped after the 3rd step
    assert [(s["batch"], s["tokens"]) for s in tags.steps] == [(2, 12), (2, 2), (0, 0)]
    assert tags.steps[0]["floor_s"] == pytest.approx(2 * 50 * 12 / e2e.MATMUL_PEAK_FLOP_S)
    assert tags.steps[1]["floor_s"] == pytest.approx(1000 + 10 * (10 + 20))  # each request reads its cached tokens and the new one
    tags.restore()
    assert "step" not in vars(scheduler) and not vars(scheduler.launcher)


def test_the_floor_parts_add_up_to_the_floor():
    lengths = [(2, 3), (5, 1), (4, 4)]
    parts = e2e.floor_parts(lengths, weights=100, kv_per_token=10, matmul_params=1000, tb_s=1e-12)
    # decode steps 0..2: requests (2, 3) and (4, 4) over 3 and 5 tokens, then 4 and 6, then (4, 4) alone over 7
    assert parts["decode"] == pytest.approx(3 * 100 + 10 * (3 + 5 + 4 + 6 + 7))
    assert parts["prefill"] == pytest.approx(2 * 1000 * 11 / e2e.MATMUL_PEAK_FLOP_S)
    assert sum(parts.values()) == pytest.approx(e2e.floor_seconds(lengths, 100, 10, 1000, 1e-12))


def event(id, name, start, end, device=False, linked=0, annotation=False) -> FunctionEvent:
    return FunctionEvent(id=id, name=name, thread=1, start_us=start, end_us=end, is_user_annotation=annotation,
                         device_type=DeviceType.CUDA if device else DeviceType.CPU, linked_correlation_id=linked)


def fake_profile(events: list[FunctionEvent]) -> SimpleNamespace:
    averages = [SimpleNamespace(key=e.name, self_device_time_total=e.time_range.elapsed_us(), count=1, device_type=e.device_type,
                                is_user_annotation=e.is_user_annotation) for e in events]
    return SimpleNamespace(events=lambda: EventList(events), key_averages=lambda: averages)


def test_device_time_splits_by_step_and_kernels_go_to_the_step_that_launched_them():
    gemm, prefill_attn = "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", "void flashinfer::BatchPrefillWithPagedKVCacheKernel<true>"
    events = [event(1, e2e.STEP, 0, 100), event(2, e2e.LAUNCH["prefill"], 5, 90), event(5, "aten::mm", 10, 20),
              event(3, e2e.STEP, 100, 200), event(7, e2e.LAUNCH["decode"], 110, 150),
              event(40, "cudaEventSynchronize", 160, 190, linked=9),
              event(11, gemm, 30, 60, device=True, linked=5),
              event(12, prefill_attn, 95, 115, device=True, linked=5),  # launched by step 0, runs into step 1
              event(13, "_decode_split_kernel", 105, 130, device=True, linked=7),  # a graph replay's kernel: linked to the range
              event(14, "Memcpy DtoH (Device -> Pinned)", 210, 220, device=True),  # linked to no host op
              event(1, e2e.STEP, 0, 100, device=True, annotation=True), event(3, e2e.STEP, 100, 200, device=True, annotation=True)]
    records = [{"kind": "prefill", "batch": 2, "tokens": 12, "floor_s": 20e-6}, {"kind": "decode", "batch": 200, "tokens": 200, "floor_s": 40e-6}]
    p = e2e.profile_split(fake_profile(events), records, wall_s=250e-6)
    prefill, decode = p["kinds"]["prefill"], p["kinds"]["decode"]
    # busy: [30, 60], [95, 130], [210, 220] (the ranges' device copies are not device work)
    assert p["device_busy_ms"] == pytest.approx(0.075) and p["device_idle_ms"] == pytest.approx(0.175)
    assert (prefill["device_busy_ms"], prefill["device_idle_ms"]) == pytest.approx((0.035, 0.065))
    assert (decode["device_busy_ms"], decode["device_idle_ms"]) == pytest.approx((0.030, 0.070))
    assert (prefill["gemm_ms"], prefill["attention_ms"], prefill["kernel_ms"]) == pytest.approx((0.030, 0.020, 0.050))
    assert (decode["attention_ms"], decode["gemm_ms"], decode["kernel_ms"]) == pytest.approx((0.025, 0, 0.025))
    assert (decode["wait_ms"], decode["host_ms"], decode["launch_ms"]) == pytest.approx((0.030, 0.070, 0.040))
    assert (prefill["x_floor"], decode["x_floor"]) == pytest.approx((5.0, 2.5))
    assert p["unlinked_kernel_ms"] == pytest.approx(0.010) and p["outside_ms"] == pytest.approx(0.05)
    assert list(p["decode_by_batch"]) == ["bs >128"]
    assert [(k, round(ms, 6)) for k, ms, _ in p["top_gaps"]] == [("_decode_split_kernel -> Memcpy DtoH (Device -> Pinned)", 0.08),
                                                                 (f"{gemm[:32]} -> {prefill_attn[:32]}", 0.035)]
    assert [(name, group) for name, _, _, group in p["top_kernels"]][:2] == [(gemm, "gemm"), ("_decode_split_kernel", "attention")]
    assert p["kernel_groups_ms"] == pytest.approx({"gemm": 0.030, "attention": 0.045, "other": 0.010})


def test_a_missing_step_range_is_an_error():
    with pytest.raises(RuntimeError, match="expected 2 'bench.step' ranges"):
        e2e.profile_split(fake_profile([event(1, e2e.STEP, 0, 10)]), [{"kind": "other"}] * 2, wall_s=1e-5)


@pytest.mark.parametrize("name, group", [
    ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_35", "attention"),
    ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<(flashinfer::PosEnc", "attention"),
    ("void flashinfer::PersistentVariableLengthMergeStatesKernel<8u, 8u, 16u", "attention"),
    ("_decode_merge_kernel", "attention"), ("_extend_kernel", "attention"),
    ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>", "other"),
    ("_rotary_kv_write_kernel", "other"), ("Memcpy DtoH (Device -> Pinned)", "other"), ("triton_red_fused_argmax_38", "other"),
])
def test_kernel_groups_by_name(name, group):
    assert timing.kernel_group(name) == group


def test_a_failed_profile_leaves_the_timed_row_and_no_profiler_running(monkeypatch, tmp_path, capsys):
    timed_generate = e2e.steps.timed_generate

    def failing_under_the_profiler(*args, **kwargs):
        if torch.autograd._profiler_enabled():
            raise RuntimeError("the device went away")
        return timed_generate(*args, **kwargs)

    monkeypatch.setattr(e2e.steps, "timed_generate", failing_under_the_profiler)
    (row,) = e2e.main(["--model", "tiny-llama", "--backends", "torch_native", "--workloads", "fixed", "--requests", "2",
                       "--fixed-shape", "8", "2", "--profile", "fixed", "--out", str(tmp_path), *CPU])
    assert row["profile"] == {"error": "RuntimeError: the device went away"} and row["tok_s"] > 0
    assert not torch.autograd._profiler_enabled()
    assert "profiled fixed torch_native (cache on, extend graph on): failed: RuntimeError" in capsys.readouterr().out


def test_a_profiled_requests_own_range_is_not_device_work():
    """bench.steps.request_split (bench.ttft --profile): on CUDA the request's record_function range
    comes back as a device event spanning its kernels; counted, it would fill the gap between them."""
    from bench import steps

    events = [event(1, steps.REQUEST, 0, 1000), event(2, "aten::mm", 100, 150),
              event(3, steps.REQUEST, 200, 900, device=True, annotation=True),
              event(4, "gemm_kernel", 200, 300, device=True), event(5, "attention_kernel", 700, 900, device=True)]
    split = steps.request_split(fake_profile(events))
    assert split["device_busy_ms"] == pytest.approx(0.3)  # the two kernels, 100 + 200 us
    assert split["device_idle_ms"] == pytest.approx(0.4)  # 300..700
    assert split["lead_ms"] == pytest.approx(0.2) and split["tail_ms"] == pytest.approx(0.1)
    assert steps.REQUEST not in dict((name, ms) for name, ms, _ in split["top_kernels"])


def test_kernels_go_to_the_window_of_their_host_event_where_torch_links_none():
    """torch before 2.13 (the GPU machine's 2.11) has no FunctionEvent.linked_correlation_id: the
    kernels are listed on their host event (FunctionEvent.kernels) and go to that event's window."""
    from bench import timing

    def host(start, *kernels):
        return SimpleNamespace(time_range=SimpleNamespace(start=start), device_type=DeviceType.CPU,
                               kernels=[SimpleNamespace(name=n, duration=d) for n, d in kernels])

    gemm, attn = "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", "_decode_split_kernel"
    events = [host(10, (gemm, 30.0), (attn, 20.0)), host(110, (attn, 25.0)), host(300, ("vectorized_elementwise_kernel", 5.0)),
              SimpleNamespace(time_range=SimpleNamespace(start=40), device_type=DeviceType.CUDA)]  # a device event: counted once, on its host event
    per, outside = timing.launched(SimpleNamespace(events=lambda: events), [(0, 100), (100, 200)])
    assert per == [{"gemm": 30.0, "attention": 20.0}, {"attention": 25.0}] and outside == {"other": 5.0}
