"""The CUDA paths of quant_fp8, and which launch each GEMM gets.

  per-tensor weight, per-tensor activations: torch._scaled_mm with two scalar scales (any output
    dtype; at the FP8 weight-read floor at decode sizes)
  per-channel or per-tensor weight, per-token or per-tensor activations:
    M <= DECODE_MAX_TOKENS: kernels.channel_matmul, scales applied in the epilogue, any model dtype
    larger M: torch._scaled_mm row-wise (scale_a [M, 1], scale_b [1, N]; bf16 output only, so fp16
    and fp32 models keep the Triton kernel)
    where the table says "tensorwise": torch._scaled_mm with tensor-wise scales of 1 (cuBLAS's FP8
    GEMM, at the weight-read floor at decode sizes where the row-wise one is not) into fp32, then
    kernels.scale_rows_columns applies both scales (and the bias) in one launch; any model dtype
  block weights, 1 x bk activation groups: kernels.block_matmul at every M
  weight-only (no activation quantization): the dequantizing reference

Per-token and per-group activations are quantized by kernels.quantize_rows (or inside the GEMM),
with the numbers quantize.py gives on CUDA; a per-token bound (Fp8Scheme.activation_scale_ub,
fbgemm_fp8) goes to both, so every path takes scale = min(amax, ub) / 448.

Launches come from a table per card, `configs/<torch.cuda.get_device_name(), spaces as
underscores>.json` beside this module, or the file given by `--fp8.configs` (none at all with
`--no-fp8.tuned`: default_launch chooses every launch), written by tune.py:

    {"device": "NVIDIA H100 80GB HBM3", "tuned": true, "triton": "3.6.0", "torch": "2.11.0",
     "entries": [{"kernel": "channel", "N": 6144, "K": 4096, "tokens": 8, "use": "triton",
                  "block_n": 64, "block_k": 256, "split_k": 3, "num_warps": 4, "num_stages": 4,
                  "fuse_quant": true, "gemv": false, "us": 9.1, "default_us": 9.8, "scaled_mm_us": 12.3}, ...]}

keyed by the kernel ("channel", or "block" with its "block": [bn, bk]), the weight's N and K, and a
token count: M takes the entry of its bucket (M padded to a power of two, at least 16) measured
nearest to M. "use": "scaled_mm" sends a bf16 channel GEMM of that bucket to torch._scaled_mm row-wise,
"tensorwise" a channel GEMM of any dtype to the tensor-wise one and the scale kernel. "gemv": true
(up to kernels.GEMV_MAX_ROWS tokens; false when absent, as in tables written before it) runs the
GEMV kernel, and serves only M up to that limit: a larger M of the bucket takes its other entries.
Shapes and buckets the table lacks take default_launch and the DECODE_MAX_TOKENS threshold.
Which table a layer uses is its TableSource (the two options), carried by Fp8Config to every
Fp8LinearMethod and into each cached choice, so engines of one process keep their own tables.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton

from backplane.plugins.quant_fp8.kernels import (GEMV_MAX_ROWS, Launch, block_m_for, block_matmul, channel_matmul,
                                                 quantize_rows, scale_rows_columns)
from backplane.plugins.quant_fp8.options import BUNDLED, TableSource
from backplane.plugins.quant_fp8.reference import quantize_input, reference_linear
from backplane.plugins.quant_fp8.scheme import Fp8Scheme

DECODE_MAX_TOKENS = 64  # up to here the Triton kernel, above it torch._scaled_mm (bf16, no table entry)
FUSE_QUANT_MAX_BYTES = 32 << 10  # x up to this size is quantized inside channel_matmul by default
SMEM_PER_SM = 228 << 10  # H100 / H200 shared memory per SM: how many programs of a launch are resident at once
MAX_PROGRAMS_PER_SM = 4
MIN_STEPS_PER_SPLIT = 4  # the default split-K keeps at least this many K steps in each slice
MAX_SPLIT_K = 16
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
KERNELS = ("channel", "block")
USES = ("triton", "scaled_mm", "tensorwise")
_LAUNCH_FIELDS = ("block_n", "block_k", "split_k", "num_warps", "num_stages", "fuse_quant", "gemv")
_OPTIONAL_FIELDS = {"gemv": False}  # launch fields added later: an entry without one has this value
_ENTRY_FIELDS = ("kernel", "N", "K", "tokens", "use", *(f for f in _LAUNCH_FIELDS if f not in _OPTIONAL_FIELDS))

TableKey = tuple[str, int, int, tuple[int, int] | None]  # (kernel, N, K, weight block or None)


def cuda_linear(scheme: Fp8Scheme, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                input_scale: torch.Tensor | None, bias: torch.Tensor | None,
                counters: torch.Tensor | None = None, source: TableSource = BUNDLED) -> torch.Tensor:
    """x [M, K] in the model dtype -> [M, N] in the same dtype. weight [N, K] fp8 (row-major).
    counters: the layer's kernels.new_counters(weight) (split-K; else allocated per call).
    source: the launch table the layer's config names, and whether its Triton GEMMs launch with PDL."""
    m, k, n = x.shape[0], x.shape[1], weight.shape[0]
    if scheme.activations == "none" or (scheme.weights == "block") != (scheme.activations == "group"):
        return reference_linear(scheme, x, weight, weight_scale, input_scale, bias)
    if scheme.weights == "block":
        _, launch = choose(("block", n, k, scheme.block), m, x.dtype, x.device, source)
        return block_matmul(x, weight, weight_scale, scheme.block, bias, launch, counters, pdl=source.pdl)
    if scheme.weights == "tensor" and scheme.activations == "tensor":
        q, x_scale = quantize_input(scheme, x, input_scale)
        fused_bias = bias if x.dtype != torch.float32 else None  # NOTE: _scaled_mm takes no bias with fp32 out
        y = torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=weight_scale.float(), bias=fused_bias,
                             out_dtype=x.dtype)
        return y if bias is None or fused_bias is not None else y + bias
    use, launch = choose(("channel", n, k, None), m, x.dtype, x.device, source)
    if use == "scaled_mm":
        return _rowwise(scheme, x, weight, weight_scale, input_scale, bias)
    if use == "tensorwise":
        return tensorwise(scheme, x, weight, weight_scale, input_scale, bias)
    if scheme.activations == "tensor":  # static or dynamic: one scale, from torch
        q, x_scale = quantize_input(scheme, x, input_scale)
        return channel_matmul(q, weight, weight_scale, bias, launch, counters, x_scale, out_dtype=x.dtype,
                              pdl=source.pdl)
    return channel_matmul(x, weight, weight_scale, bias, launch, counters, scale_ub=scheme.activation_scale_ub,
                          pdl=source.pdl)


def _rowwise(scheme: Fp8Scheme, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """_scaled_mm with row-wise scales: scale_a [M, 1] per token, scale_b [1, N] per output channel."""
    m, n = x.shape[0], weight.shape[0]
    if scheme.activations == "token":
        q, x_scale = quantize_rows(x, scale_ub=scheme.activation_scale_ub)
    else:
        q, x_scale = quantize_input(scheme, x, input_scale)
    scale_a = x_scale.float().reshape(-1, 1).expand(m, 1).contiguous()
    scale_b = weight_scale.float().reshape(1, -1).expand(1, n).contiguous()  # [N, 1] or [] -> [1, N]
    y = torch._scaled_mm(q, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    return y if bias is None else y + bias


def tensorwise(scheme: Fp8Scheme, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """x quantized (per token, or the scheme's tensor scale), torch._scaled_mm with scales of 1 into
    fp32, then both scales and the bias in one kernel: y = acc * sx[m] * sw[n] (+ bias), x's dtype."""
    if scheme.activations == "token":
        q, x_scale = quantize_rows(x, scale_ub=scheme.activation_scale_ub)
    else:
        q, x_scale = quantize_input(scheme, x, input_scale)
    one = unit_scale(x.device)
    acc = torch._scaled_mm(q, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    return scale_rows_columns(acc, x_scale, weight_scale, bias, x.dtype)


@functools.cache
def unit_scale(device: torch.device) -> torch.Tensor:
    """An fp32 1.0 on `device` for _scaled_mm's tensor-wise scales. NOTE: made once, before any graph
    capture (Fp8LinearMethod asks for it after loading): a tensor first made inside a capture would
    hold nothing until the graph replays."""
    return torch.ones((), dtype=torch.float32, device=device)


# -- launch choice --------------------------------------------------------------------------------

def choose(key: TableKey, m: int, dtype: torch.dtype, device: torch.device,
           source: TableSource = BUNDLED) -> tuple[str, Launch]:
    """("triton" or "scaled_mm", the Triton launch) for a GEMM of M rows: the entry for M's bucket in
    the table of `source` (default: the card's bundled one), else the defaults. scaled_mm only for a
    bf16 channel GEMM."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _choose(key, m, dtype, index, source)


@functools.lru_cache(maxsize=4096)
def _choose(key: TableKey, m: int, dtype: torch.dtype, device_index: int, source: TableSource) -> tuple[str, Launch]:
    found = table_for(torch.cuda.get_device_name(device_index), source).lookup(key, m)
    if found is not None:
        use, launch = found
    else:
        sms = torch.cuda.get_device_properties(device_index).multi_processor_count
        use = "triton" if m <= DECODE_MAX_TOKENS else "scaled_mm"
        launch = default_launch(key, m, torch.empty((), dtype=dtype).element_size(), sms)
    rowwise_only_bf16 = use == "scaled_mm" and dtype != torch.bfloat16  # _scaled_mm row-wise: bf16 out only
    return ("triton" if key[0] != "channel" or rowwise_only_bf16 else use), launch


def default_launch(key: TableKey, m: int, x_bytes: int, num_sms: int) -> Launch:
    """The rule where the table is silent. Decode sizes stream the weight: 16 KB weight tiles per K
    step (64 x 256, or 128 x 128 when 64-column tiles would not all be resident at once), 4 stages,
    and K split so that every program of the launch is resident at once (one wave) with at least
    MIN_STEPS_PER_SPLIT K steps each, the same number in every slice; x quantized inside the GEMM
    while small (at most FUSE_QUANT_MAX_BYTES; block: each 1 x bk group as it is loaded), else by
    quantize_rows first. Larger M: 64 x 128 tiles, one K slice, x quantized first.

    NOTE: inside the GEMM every program of a column tile quantizes the same rows again, so the
    work grows with M times the number of tiles. Block-wise FP8 always fused until 2026-12-07: at
    bs 32 its 8B decode step took 1.11x bf16's where the (unfused) channel kernel's took 0.80x
    (docs/performance.md, H100); both fused at bs 1 (0.72x and 0.70x)."""
    kernel, n, k, block = key
    if m > DECODE_MAX_TOKENS:
        return Launch(block_n=128, block_k=block[1] if kernel == "block" else 128, num_warps=4, num_stages=3)
    fuse = m * k * x_bytes <= FUSE_QUANT_MAX_BYTES
    block_m, stages = block_m_for(m), 4
    tiles_k = ((64, 256) if m <= 16 else (64, 128), (128, 128)) if kernel == "channel" else ((64, block[1]), (128, block[1]))
    for block_n, block_k in tiles_k:
        smem = stages * (block_m * block_k * (x_bytes if fuse else 1) + block_k * block_n)
        slots = num_sms * max(1, min(MAX_PROGRAMS_PER_SM, SMEM_PER_SM // smem))
        tiles = triton.cdiv(n, block_n)
        if tiles <= slots:
            break
    steps = triton.cdiv(k, block_k)
    most = min(slots // tiles, steps // MIN_STEPS_PER_SPLIT, MAX_SPLIT_K)
    split = max((s for s in range(1, most + 1) if steps % s == 0), default=1)
    return Launch(block_n=block_n, block_k=block_k, split_k=split, num_warps=4, num_stages=stages, fuse_quant=fuse)


def bucket(m: int) -> int:
    """The token bucket of M rows: M padded to a power of two, at least 16 (one BLOCK_M up to 64)."""
    return max(16, triton.next_power_of_2(m))


@dataclass
class LaunchTable:
    """TableKey -> {token count: (use, Launch)}, from one JSON file (or empty: the defaults decide)."""

    source: str = ""
    tuned: bool = False
    entries: dict[TableKey, dict[int, tuple[str, Launch]]] = field(default_factory=dict)

    def lookup(self, key: TableKey, m: int) -> tuple[str, Launch] | None:
        """The entry of M's bucket measured nearest to M (log scale; a tie goes to the larger count),
        among those whose launch serves M rows (a GEMV launch, up to GEMV_MAX_ROWS)."""
        same = {t: v for t, v in self.entries.get(key, {}).items()
                if bucket(t) == bucket(m) and not (v[1].gemv and m > GEMV_MAX_ROWS)}
        if not same:
            return None
        target = math.log2(max(m, 1))
        return same[min(same, key=lambda t: (abs(math.log2(t) - target), -t))]

    def __len__(self) -> int:
        return sum(len(v) for v in self.entries.values())

    @classmethod
    def from_json(cls, data: dict, source: str) -> LaunchTable:
        entries = data.get("entries") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise ValueError(f"{source}: expected a JSON object with a list \"entries\", got {type(data).__name__}")
        table = cls(source=source, tuned=bool(data.get("tuned", False)))
        for i, entry in enumerate(entries):
            key, tokens, use, launch = _parse_entry(entry, f"{source}: entry {i}")
            table.entries.setdefault(key, {})[tokens] = (use, launch)
        return table


def _parse_entry(entry: dict, where: str) -> tuple[TableKey, int, str, Launch]:
    missing = [name for name in _ENTRY_FIELDS if name not in entry]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}; expected the fields {', '.join(_ENTRY_FIELDS)}")
    kernel, use, block = entry["kernel"], entry["use"], entry.get("block")
    if kernel not in KERNELS or use not in USES or int(entry["tokens"]) < 1:
        raise ValueError(f"{where}: kernel {kernel!r}, use {use!r}, tokens {entry['tokens']!r}: expected kernel one "
                         f"of {', '.join(KERNELS)}, use one of {', '.join(USES)}, tokens >= 1")
    if (kernel == "block") != (isinstance(block, list) and len(block) == 2):
        raise ValueError(f"{where}: block {block!r}: expected [rows, columns] for kernel 'block' and none for 'channel'")
    gemv = entry.get("gemv", _OPTIONAL_FIELDS["gemv"])
    if not isinstance(gemv, bool) or (gemv and int(entry["tokens"]) > GEMV_MAX_ROWS):
        raise ValueError(f"{where}: gemv {gemv!r} at tokens {entry['tokens']!r}: expected true or false (false when "
                         f"absent), true only up to {GEMV_MAX_ROWS} tokens")
    try:
        launch = Launch(**{name: entry.get(name, _OPTIONAL_FIELDS.get(name)) for name in _LAUNCH_FIELDS})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    key = (kernel, int(entry["N"]), int(entry["K"]), tuple(int(b) for b in block) if block else None)
    return key, int(entry["tokens"]), use, launch


def entry(key: TableKey, tokens: int, use: str, launch: Launch, **timings: float) -> dict:
    """One JSON entry of the table (the inverse of _parse_entry), with its timings in µs."""
    kernel, n, k, block = key
    return {"kernel": kernel, "N": n, "K": k, **({"block": list(block)} if block else {}), "tokens": tokens,
            "use": use, **{name: getattr(launch, name) for name in _LAUNCH_FIELDS}, **timings}


def device_file_name(device_name: str) -> str:
    """configs/ file name of a device, from torch.cuda.get_device_name()."""
    return device_name.strip().replace(" ", "_") + ".json"


def load_table(path: str | Path, option: str | None = None) -> LaunchTable:
    """The table in `path`; a ValueError of one line otherwise. option: the setting that named the file
    (`--fp8.configs`), which the error then names with its fix."""
    path = Path(path)
    where = f"{option} {path}" if option else f"quant_fp8 launch table {path}"
    fix = f"; fix: point {option} at a file tune.py wrote, or leave it unset for the GPU's bundled table" if option else ""
    written_by = "expected a JSON launch table written by python -m backplane.plugins.quant_fp8.tune"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{where} does not exist; {written_by}{fix}") from None
    except OSError as exc:
        raise ValueError(f"{where} cannot be read ({exc.strerror}); {written_by}{fix}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where} is not JSON ({exc}); {written_by}{fix}") from None
    try:
        return LaunchTable.from_json(data, where)
    except ValueError as exc:
        raise ValueError(f"{exc}{fix}") from None


def table_source(configs: str, tuned: bool = True, pdl: bool = True) -> TableSource:
    """The TableSource of `--fp8.configs PATH` (and `--fp8.tuned`), the file read (and refused in one
    line naming the option) now, at engine build, rather than at the first forward."""
    path = Path(configs).expanduser().resolve()
    stamp = path.stat().st_mtime_ns if path.is_file() else None
    source = TableSource(str(path), tuned, stamp, pdl)
    _configured_table(source.configs, stamp)  # NOTE: also loaded with tuned false, so a wrong path never waits
    return source


@functools.cache
def table_for(device_name: str, source: TableSource = BUNDLED) -> LaunchTable:
    """The table `source` names: none when it is untuned, the configured file, else the bundled table
    of this GPU, else an empty one."""
    if not source.tuned:
        return LaunchTable()
    if source.configs is not None:
        return _configured_table(source.configs, source.stamp)
    bundled = CONFIG_DIR / device_file_name(device_name)
    return load_table(bundled) if bundled.exists() else LaunchTable()


@functools.cache
def _configured_table(path: str, stamp: int | None) -> LaunchTable:
    return load_table(path, option="--fp8.configs")
