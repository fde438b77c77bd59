"""Named groups of GPU tests and benchmarks, run inside one device call's time. On the GPU machine,
carrying .device (../shared/device/README.md):

    tar -xJf .device/site.tar.xz -C /tmp && export PYTHONPATH=/tmp/site &&
    python3 -m pip install -q --no-deps --no-build-isolation -e . && python3 -m bench.run decode-1b --commit abc1234

All jobs share one deadline, --budget seconds after the start: a job runs until it ends or the
deadline (pytest gets SIGINT, so it still prints its summary); one with less than MIN_JOB_S left is
not started. A `together` job runs beside the jobs after it, up to the next one that is not. Each
group's logs and result JSON go to $OUT/<group>/, packed as $OUT/<group>.tar.gz (a call brings back
at most 8 files); a summary table comes last. --commit names the commit in result files (the copy of
the tree there has no git). FlashInfer modules JIT-built on an earlier machine (--save-flashinfer-aot
writes them as flashinfer-aot.tar.xz.part-*; put those in .device/) are installed prebuilt.
bench/gpu_suite.sh wraps test areas and groups into one call, each under its own limit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.report import COMMIT_ENV, table

MIN_JOB_S, GRACE_S = 30, 15  # a job needs MIN_JOB_S to start; SIGKILL GRACE_S after the deadline's SIGINT
SERIAL = "share_the_pool or shares_the_pool"  # tests that read the device's free memory: run alone
AOT_PARTS = ".device/flashinfer-aot.tar.xz.part-*"
SUMMARY = [("group", "group", ""), ("job", "job", ""), ("rc", "rc", ""), ("s", "seconds", ".0f"), ("last line", "last", "")]


@dataclass(frozen=True)
class Job:
    """One command, run as `python <argv>`; "{out}" in argv is the group's folder."""

    name: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    together: bool = False


def tests(name: str, *paths: str, k: str | None = None, together: bool = False, env=()) -> Job:
    """pytest -m gpu over `paths` (and -k k)."""
    argv = ("-m", "pytest", "-m", "gpu", "-q", "-rfE", "-p", "no:cacheprovider", "--durations=5", *paths)
    return Job(name, argv + (("-k", k) if k else ()), tuple(env), together)


def bench(name: str, command: str) -> Job:
    """`python -m bench.<command>`, e.g. bench("e2e-8b", "e2e --model llama-3.1-8b")."""
    return Job(name, ("-m", f"bench.{command.split()[0]}", *command.split()[1:]))


def matrix_shards(n: int) -> list[Job]:
    return [tests(f"matrix-{i}", "tests/gpu/test_combinations_gpu.py", together=i < n - 1,
                  env=(("BACKPLANE_MATRIX_SHARD", f"{i}/{n}"), ("BACKPLANE_MATRIX_OUT", f"{{out}}/matrix-{i}.json")))
            for i in range(n)]


GPU = "tests/gpu/test_{}_gpu.py".format
DECODE_TESTS = (GPU("attention_triton"), GPU("overlap"), GPU("graph_runner"))
LORA_TESTS, PARALLEL = (GPU("lora"), GPU("lora_triton")), f"not ({SERIAL})"
PREFIX_CACHE = "--workloads shared-prefix distinct --cache on off"
GROUPS: dict[str, list[Job]] = {
    "quick": [tests("quick-triton", *DECODE_TESTS, k=PARALLEL, together=True),
              tests("quick-flashinfer", GPU("attention_flashinfer"))],
    "tests": [tests("tests-flashinfer", GPU("attention_flashinfer"), k=PARALLEL, together=True),
              tests("tests-conformance", GPU("conformance"), k=PARALLEL, together=True),
              tests("tests-model-spec", GPU("model_backends"), GPU("spec"), k=PARALLEL, together=True),
              tests("tests-ops", GPU("ops_triton"), "tests/ops/test_ops.py", together=True),
              tests("tests-triton-graphs-lora", *DECODE_TESTS, *LORA_TESTS, GPU("prefix_cache"),
                    "tests/models/test_models_vs_hf.py", "tests/distributed/test_tp.py", k=PARALLEL),
              tests("tests-graph-memory", GPU("graph_runner"), GPU("spec"), k=SERIAL)],
    "matrix": matrix_shards(int(os.environ.get("BACKPLANE_MATRIX_JOBS", "4"))),  # shards side by side on the one GPU
    "kernels": [bench("attention", "attention --sweep"), bench("lora-kernels", "lora_kernels"), bench("ops", "ops")],
    # the FP8 KV cache's decode kernel (triton's launch settings swept) against the bf16 pool's, one call
    "fp8-kv-attn": [tests("fp8-kv-attn-tests", "tests/attention/test_fp8_kv_decode_gpu.py"),
                    bench("attention-bf16-kv", "attention --only decode --decode-cases 8x16384 1x16384 32x4096 64x2048"),
                    bench("attention-fp8-kv", "attention --only decode --kv-dtype fp8_e4m3 --sweep --decode-cases "
                          "8x16384 1x16384 32x4096 64x2048")],
    # b0ba2e7's FP8-KV defaults through the engine: the GPU tests over FP8 pools, then issue 39's FP8-KV row
    # (llama-3.1-8b, bs 8 x 16k, both backends against bf16 KV), one call
    "fp8-kv-step": [tests("fp8-kv-step-tests", "tests/gpu/test_fp8_kv_gpu.py", "tests/attention/test_fp8_kv_decode_gpu.py"),
                    bench("fp8-kv-step-8b", "decode --models llama-3.1-8b --backends triton flashinfer --variants overlap "
                          "fp8-kv --batch-sizes 8 --context 16384 --steps 32 --rounds 3 --no-peer")],
    "attention-1b": [bench("attention-hd64", "attention --only decode --sweep --head-dim 64 --decode-cases 1x512 8x512 "
                           "32x512 32x2048")],
    "ops": [tests("ops-tests", GPU("ops_triton")), bench("ops", "ops")],
    "graphs": [Job(f"graphs-vs-eager-{b}", ("-m", "backplane.cli", "bench", "--json", "--model", "llama-3.2-1b",
                                            "--attention-backend", b, "--batch-size", "1", "8", "32", "64"))
               for b in ("triton", "flashinfer")],
    "decode-1b": [bench("decode-1b", "decode --models llama-3.2-1b --profile 1 32")],
    "decode-8b": [bench("decode-8b", "decode --models llama-3.1-8b --profile 1")],
    "compile": [bench("compile", "decode --models llama-3.2-1b --variants overlap compiled --rounds 3")],
    "prefill-1b": [bench("prefill-1b", "prefill --models llama-3.2-1b")],
    "prefill-8b": [bench("prefill-8b", "prefill --models llama-3.1-8b")],
    "ttft": [bench("ttft-1b", "ttft --models llama-3.2-1b --profile fresh-512 repeat-512"),
             bench("ttft-8b", "ttft --models llama-3.1-8b --fresh 512 --prefix 0 0 --repeats 5")],  # issue 38 asks 8B for the cached prompt: ran out of 229 s in full
    "ttft-1b": [bench("ttft-1b", "ttft --models llama-3.2-1b")],
    "ttft-8b": [bench("ttft-8b", "ttft --models llama-3.1-8b --fresh 512 --prefix 0 0 --repeats 5")],
    # where a request's host time goes on the GPU (the real model and its graphs, each device op by call site)
    "host-gpu": [bench(f"host-1b-{b}", f"host_path --device cuda --model llama-3.2-1b --real-model --device-ops "
                       f"--attention-backend {b} --fresh 128 512 --repeat 512 --decode-context 512 --rounds 3 "
                       "--requests 20 --profile 30") for b in ("triton", "flashinfer")],
    "host-gpu-triton": [bench("host-1b-triton", "host_path --device cuda --model llama-3.2-1b --real-model --device-ops "
                              "--attention-backend triton --fresh 128 512 --repeat 512 --decode-context 512 --rounds 3 "
                              "--requests 20")],
    "e2e-1b": [bench("e2e-1b", "e2e --model llama-3.2-1b --repeats 3 --profile sharegpt-like")],
    "e2e-8b": [bench("e2e-8b", "e2e --model llama-3.1-8b")],
    "e2e-why": [bench("e2e-why-1b", "e2e --model llama-3.2-1b --workloads sharegpt-like --backends triton --extend-graph on off "
                      "--repeats 3 --profile sharegpt-like")],  # issue 38: the A/B and where the time goes (triton: flashinfer ran within 1% of it at c27bdcf)
    "e2e-extend-graph": [bench("e2e-extend-graph-1b", "e2e --model llama-3.2-1b --workloads sharegpt-like "
                               "--extend-graph on off --repeats 3")],
    "prefix-cache": [tests("prefix-cache-tests", GPU("prefix_cache")),
                     bench("prefix-cache", f"e2e --model llama-3.2-1b {PREFIX_CACHE} --repeats 3")],
    "prefix-cache-8b": [bench("prefix-cache-8b", f"e2e --model llama-3.1-8b {PREFIX_CACHE} --repeats 2")],
    "lora": [tests("lora-tests", *LORA_TESTS), bench("lora", "lora"), bench("lora-kernels", "lora_kernels")],
    "lora-tune": [bench("lora-tune", "lora_kernels --ranks 16 64 --tokens 1 8 32 --tune {out}/lora_triton_configs.json")],
    "spec": [tests("spec-tests-triton", GPU("spec"), GPU("conformance"), k=f"triton and (eagle or graphs) and {PARALLEL}",
                   together=True),
             tests("spec-tests-flashinfer", GPU("spec"), GPU("conformance"), k=f"flashinfer and (eagle or graphs) and {PARALLEL}"),
             tests("spec-tests-pool", GPU("spec"), k=SERIAL), bench("spec", "spec")],
    "serving": [bench("serving", "serving --model llama-3.2-1b -- --attention-backend triton")],
    "moe": [tests("moe-tests", "tests/plugins/moe_triton/test_moe_triton_gpu.py"), bench("moe-layer", "moe_layer")],
    "moe-tune": [Job("moe-tune", ("-m", "backplane.plugins.moe_triton.tune", "--out", "{out}/moe_triton_configs.json",
                                  "--budget", "420"))],
    "moe-decode": [bench("moe-decode", "moe_decode")],
    # bs 1 profiled on the bundled launch table, then on one the quick tune writes first (one call, one model at a time)
    "moe-bs1": [Job("moe-bs1-tune", ("-m", "backplane.plugins.moe_triton.tune", "--shapes", "qwen3-30b-a3b", "--tokens",
                                     "1", "2", "4", "8", "16", "32", "--budget", "150", "--out", "{out}/moe_triton_configs.json")),
                bench("moe-bs1-bundled", "moe_decode --batch-sizes 1 --rounds 5 --profile 1"),
                bench("moe-bs1-tuned", "moe_decode --batch-sizes 1 --rounds 5 --profile 1 --moe-configs {out}/moe_triton_configs.json")],
    # one token's fixed layout (6cf05a4) against align's sort, bs 1, the bundled table: two processes
    "moe-one-token-ab": [bench("moe-decode-sorted-one-token", "moe_decode --batch-sizes 1 --rounds 5 --no-one-token-layout"),
                         bench("moe-decode-one-token-layout", "moe_decode --batch-sizes 1 --rounds 5")],
    # the fused router (4a29b89) against the default, bs 1, one call: two processes, each with its peer
    "moe-route-ab": [bench("moe-decode-native-route", "moe_decode --batch-sizes 1 --rounds 5 --custom-ops moe_route=native"),
                     bench("moe-decode-triton-route", "moe_decode --batch-sizes 1 --rounds 5 --custom-ops moe_route=triton")],  # one process: engine and peer share the ~61 GB of weights
    "quant-decode": [bench("quant-decode-8b", "decode --models llama-3.1-8b --backends triton --variants overlap fp8 fp8-block "
                           "--batch-sizes 1 32 --rounds 3 --no-peer --profile 1"),
                     bench("fp8-kv-8b", "decode --models llama-3.1-8b --backends triton flashinfer --variants overlap "
                           "fp8-kv --batch-sizes 8 --context 16384 --steps 32 --rounds 3 --no-peer")],
    "quant-prefill": [bench("quant-prefill-8b", "prefill --models llama-3.1-8b --backends triton --cases 4x2048 1x512 "
                            "--probe 0 0 --repeats 3 --quantization none fp8")],
    "quant-e2e": [bench("quant-e2e-8b", "e2e --model llama-3.1-8b --backends triton --workloads fixed "
                        "--quantization none fp8 --kv-cache-dtype auto fp8_e4m3")],
    "quant-kernels": [tests("quant-tests", "tests/plugins/quant_fp8"), bench("quant-kernels", "quant_kernels")],
    # issue 39's rows at 1B (no targets there): decode, FP8 KV, prefill, end to end and the GEMMs, one call
    "quant-1b": [bench("quant-decode-1b", "decode --models llama-3.2-1b --backends triton --variants overlap fp8 fp8-block "
                       "--batch-sizes 1 32 --rounds 3 --no-peer"),
                 bench("fp8-kv-1b", "decode --models llama-3.2-1b --backends triton --variants overlap fp8-kv "
                       "--batch-sizes 8 --context 16384 --steps 32 --rounds 3 --no-peer"),
                 bench("quant-prefill-1b", "prefill --models llama-3.2-1b --backends triton --cases 4x2048 1x512 "
                       "--probe 0 0 --repeats 3 --quantization none fp8"),
                 bench("quant-e2e-1b", "e2e --model llama-3.2-1b --backends triton --workloads fixed "
                       "--quantization none fp8 --kv-cache-dtype auto fp8_e4m3"),
                 bench("quant-kernels-1b", "quant_kernels --model llama-3.2-1b")],
    # e0aab88's GEMV launches and the tensor-wise _scaled_mm path: their GPU tests, a re-tune of 1 and 8
    # tokens over the bundled table (both among the candidates), the kernels and the 8B decode step on it
    "quant-gemv": [tests("quant-gemv-tests", "tests/plugins/quant_fp8/test_gemv_kernel_gpu.py",
                         "tests/plugins/quant_fp8/test_tensorwise_gpu.py"),
                   Job("quant-gemv-tune", ("-m", "backplane.plugins.quant_fp8.tune", "--tokens", "1", "8", "--update",
                                           "bundled", "--out", "{out}/quant_fp8_configs.json", "--budget", "300")),
                   bench("quant-gemv-kernels", "quant_kernels --tokens 1 8 32 --configs {out}/quant_fp8_configs.json"),
                   Job("quant-gemv-decode", ("-m", "bench.decode", "--models", "llama-3.1-8b", "--backends", "triton",
                                             "--variants", "overlap", "fp8", "fp8-block", "--batch-sizes", "1", "32",
                                             "--rounds", "3", "--no-peer"),
                       env=(("BACKPLANE_FP8__CONFIGS", "{out}/quant_fp8_configs.json"),))],
    # programmatic dependent launch of the FP8 GEMMs: on (the default) against off, one process, bs 1 and 32
    # (four 8B engines: a fifth, fp8-block-nopdl, did not fit an H100 at ccd375d)
    "quant-pdl": [bench("quant-pdl-8b", "decode --models llama-3.1-8b --backends triton --variants overlap fp8 fp8-nopdl "
                        "fp8-block --batch-sizes 1 32 --rounds 3 --no-peer")],
    "quant-tune": [Job("quant-tune", ("-m", "backplane.plugins.quant_fp8.tune", "--out", "{out}/quant_fp8_configs.json",
                                      "--budget", "420"))],
}


def prepare() -> list[str]:
    """The environment every job inherits, FlashInfer's prebuilt modules installed; what the machine has."""
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
                      PYTHONUNBUFFERED="1")
    lines = [_shell("nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader") or "no nvidia-smi"]
    import importlib.util

    spec = importlib.util.find_spec("flashinfer")
    aot = Path(spec.submodule_search_locations[0]) / "data" / "aot" if spec else None
    if aot and not aot.exists() and list(Path.cwd().glob(AOT_PARTS)):
        aot.mkdir(parents=True)
        _shell(f"cat {AOT_PARTS} | tar -xJ -C {aot}")
        lines.append(f"flashinfer: {len(list(aot.iterdir()))} prebuilt modules from .device")
    return lines


def _shell(command: str) -> str:
    out = subprocess.run(command, shell=True, capture_output=True, text=True)
    return out.stdout.strip()


def start(job: Job, folder: Path) -> subprocess.Popen:
    argv = [a.replace("{out}", str(folder)) for a in job.argv]
    env = {**os.environ, "OUT": str(folder), **{k: v.replace("{out}", str(folder)) for k, v in job.env}}
    with open(folder / f"{job.name}.log", "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=_hear_sigint)


def _hear_sigint() -> None:
    # NOTE: a shell starts background commands (`nohup ... &`) with SIGINT ignored and children inherit
    # that, so the deadline's SIGINT would go unheard and every job would wait GRACE_S for SIGKILL
    # without pytest's summary; the job gets the default action back (Python: KeyboardInterrupt).
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finish(proc: subprocess.Popen, deadline: float) -> int:
    """The job's exit code; at the deadline SIGINT, then SIGKILL GRACE_S later."""
    for sig, timeout in ((None, max(deadline - time.monotonic(), 1)), (signal.SIGINT, GRACE_S), (signal.SIGKILL, None)):
        if sig is not None:
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.wait(timeout=timeout)
    raise AssertionError("unreachable: the wait after SIGKILL has no timeout")


def run_group(jobs: list[Job], folder: Path, deadline: float) -> list[dict]:
    """Every job of a group in order (a `together` one runs with the jobs after it); one summary row each."""
    rows, batch = [], []
    for job in jobs:
        if deadline - time.monotonic() < MIN_JOB_S:
            rows.append({"job": job.name, "rc": None, "seconds": 0, "last": "not started: the budget is spent"})
            continue
        batch.append((job, start(job, folder), time.monotonic()))
        if not job.together:
            rows += wait(batch, folder, deadline)
            batch = []
    return rows + wait(batch, folder, deadline)


def wait(batch: list, folder: Path, deadline: float) -> list[dict]:
    rows = []
    for job, proc, began in batch:
        rc = finish(proc, deadline)
        rows.append({"job": job.name, "rc": rc, "seconds": time.monotonic() - began, "last": _last_line(folder, job)})
    return rows


def _last_line(folder: Path, job: Job) -> str:
    lines = [ln for ln in (folder / f"{job.name}.log").read_text(errors="replace").splitlines() if ln.strip()]
    summary = [ln for ln in lines if ln.startswith(("FAILED", "ERROR")) or " passed" in ln or " failed" in ln]
    return (summary or lines or [""])[-1][:100]


def merge_matrix(folder: Path) -> str:
    """The matrix shards' JSON (tests/gpu/test_combinations_gpu.py) merged into matrix.json; one line."""
    results = [r for p in sorted(folder.glob("matrix-[0-9]*.json")) for r in json.loads(p.read_text())["results"]]
    counts = {s: sum(r["status"] == s for r in results) for s in ("ok", "tie", "refused", "mismatch", "error")}
    doc = {"cells": len(results), **counts, "seconds": round(sum(r["seconds"] for r in results), 1), "results": results,
           "refusals": {r["label"]: r["message"] for r in results if r["status"] == "refused"},
           "mismatches": {r["label"]: r["message"] for r in results if r["status"] == "mismatch"},
           "errors": {r["label"]: r["message"] for r in results if r["status"] == "error"},
           "ties": {r["label"]: r["ties"] for r in results if r["status"] == "tie"}}
    (folder / "matrix.json").write_text(json.dumps(doc, indent=1))
    return f"matrix: {len(results)} cells: " + ", ".join(f"{n} {s}" for s, n in counts.items())


def save_flashinfer_aot(out: Path) -> str:
    """Every FlashInfer module this machine JIT-built, as <name>/<name>.so (FlashInfer's AOT layout),
    xz-compressed in parts of at most 15 MB under `out`."""
    jit = next(Path.home().glob(".cache/flashinfer/*/*/cached_ops"), None)
    if jit is None:
        return "flashinfer: no JIT-built modules to save"
    names = sorted(str(p.relative_to(jit)) for p in jit.glob("*/*.so"))
    listing = Path(tempfile.mkstemp()[1])
    listing.write_text("\n".join(names))
    _shell(f"tar -cf - -C {jit} -T {listing} | xz -T0 -6 | split -b 15M - {out}/flashinfer-aot.tar.xz.part-")
    return f"flashinfer: {len(names)} JIT-built modules saved"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("groups", nargs="*", metavar="GROUP")
    p.add_argument("--list", action="store_true", help="print every group's jobs and exit")
    p.add_argument("--only", nargs="+", metavar="JOB", help="run only these jobs of the groups (a cold machine "
                   "may need two calls for the `tests` group: split its jobs with --only)")
    p.add_argument("--budget", type=float, default=560.0, help="seconds for all the jobs together (one call: 600)")
    p.add_argument("--commit", default=None, help="the commit to name in result files (no git on the GPU machine)")
    p.add_argument("--save-flashinfer-aot", action="store_true")
    return p.parse_args(argv)


def run_groups(ns: argparse.Namespace, out: Path, deadline: float) -> tuple[list[str], list[dict]]:
    """(notes, one summary row per job) of every named group, each in (and packed from) out/<group>."""
    lines, rows = prepare(), []
    for group in ns.groups:
        folder = out / group
        folder.mkdir(parents=True, exist_ok=True)
        jobs = [j for j in GROUPS[group] if not ns.only or j.name in ns.only]
        rows += [{"group": group, **r} for r in run_group(jobs, folder, deadline)]
        lines += [merge_matrix(folder)] if group == "matrix" else []
        if os.environ.get("OUT"):
            shutil.make_archive(str(folder), "gztar", folder)
            shutil.rmtree(folder)
    return lines + ([save_flashinfer_aot(out)] if ns.save_flashinfer_aot else []), rows


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    deadline, unknown = time.monotonic() + ns.budget, [g for g in ns.groups if g not in GROUPS]
    if ns.list or unknown or not ns.groups:
        print("\n".join(f"{name}: {', '.join(j.name for j in jobs)}" for name, jobs in GROUPS.items()))
        return 2 if unknown or not (ns.list or ns.groups) else 0
    if ns.commit:
        os.environ[COMMIT_ENV] = ns.commit
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="bench-run-"))
    lines, rows = run_groups(ns, out, deadline)
    print("\n".join(lines + [f"results under {out}", table(rows, SUMMARY)]))
    return 0 if all(r["rc"] in (0, 5) for r in rows) else 1  # 5: pytest selected no test


if __name__ == "__main__":
    sys.exit(main())
