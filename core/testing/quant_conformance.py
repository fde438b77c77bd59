"""Quantization-method conformance: a registered QuantMethodSpec on the core's own linear layers.

In a plugin's test suite:

    from backplane.testing import quant_conformance
    test_mine = quant_conformance.make_suite("mine", formats=[MY_FORMAT])

A `QuantFormat` is the plugin author's checkpoint writer for one of its formats: the
`quantization_config` its factory reads, how a layer's full-precision weights become checkpoint
tensors, and the arithmetic the method promises (the dequantized weight, the input as its matmul sees
it). `FP8_FORMATS` are writers for the standard FP8 formats (compressed-tensors per-channel and
per-tensor, block-wise "fp8"), written here independently of any plugin.

Cases, each on the core's layers (QKVParallelLinear with GQA and with replicated KV heads,
MergedColumnParallelLinear gate/up, RowParallelLinear down and o with bias, odd sizes):
  load: create_weights, the layer's weight_loader over the written tensors (q/k/v and gate/up parts
    loaded one by one, as the model loader does), process_weights_after_loading, then apply at 1, 7
    and 64 tokens against the format's dequantized reference in float64.
  tp: the same layer as two tensor-parallel ranks (ParallelContext without torch.distributed; the
    row-parallel all-reduce left to the suite): column ranks' outputs concatenated part by part equal
    the one-rank layer; each row rank equals the reference over its input columns, and their sum
    equals the one-rank layer within `row_tp_tolerance` (dynamic activation scales differ per rank).
  online (spec.supports_online): full-precision weights loaded with checkpoint_config None, then
    processed: close to the full-precision layer within `online_tolerance` and in fewer bytes.
  selection: `--quantization auto` picks the method for each declared checkpoint format (among the
    registered methods alone), the method by name loads them, and online by name works exactly when
    supports_online is declared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from backplane.contracts.quant import QuantContext

TOKENS = (1, 7, 64)
DTYPE_ROUNDING = {torch.float32: 0.0, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # output rounding, relative

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class QuantFormat:
    """One checkpoint format of the method under test.

    name: how cases name it. checkpoint_config: the `quantization_config` its factory gets.
    write(parts): the fp32 weights of one layer's logical parts ([q, k, v], [gate, up] or one
      [N, K]) -> each part's checkpoint tensors by parameter name ("weight", "weight_scale", ...);
      the parts of a fused layer may share scales (one per-tensor scale for the group).
    dequantize(tensors): one part's tensors -> the fp32 weight [N, K] the method computes with.
    quantize_input(x, parts): fp32 x [M, K] -> the input as the method's matmul sees it (quantized and
      dequantized; `parts` are the layer's written tensors, for a static input_scale); None: x itself.
    block: (rows, columns) every scale covers; the suite keeps each part and shard whole blocks.
    tolerance: max |error| / max |reference| allowed against the reference (before output rounding).
    row_tp_tolerance: the same for two row-parallel ranks summed against one rank (None: tolerance).
    """

    name: str
    checkpoint_config: dict[str, Any]
    write: Callable[[list[torch.Tensor]], list[Tensors]]
    dequantize: Callable[[Tensors], torch.Tensor]
    quantize_input: Callable[[torch.Tensor, list[Tensors]], torch.Tensor] | None = None
    block: tuple[int, int] = (1, 1)
    tolerance: float = 1e-3
    row_tp_tolerance: float | None = None

    def __str__(self) -> str:
        return self.name


# -- the standard FP8 formats ------------------------------------------------------------------------

FP8_MAX = 448.0
_MIN_SCALE = 1e-12


def _fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _amax_scale(x: torch.Tensor, **dims) -> torch.Tensor:
    return (x.abs().amax(**dims).float() / FP8_MAX).clamp(min=_MIN_SCALE)


def _per_token(x: torch.Tensor, _parts) -> torch.Tensor:
    scale = _amax_scale(x, dim=-1, keepdim=True)
    return _fp8(x, scale).float() * scale


def _static_tensor(x: torch.Tensor, parts: list[Tensors]) -> torch.Tensor:
    scale = max(float(p["input_scale"].max()) for p in parts)
    return _fp8(x, torch.tensor(scale)).float() * scale


def _groups(columns: int):
    def quantize(x: torch.Tensor, _parts) -> torch.Tensor:
        m, k = x.shape
        g = x.reshape(m, k // columns, columns)
        scale = _amax_scale(g, dim=-1, keepdim=True)
        return (_fp8(g, scale).float() * scale).reshape(m, k)
    return quantize


def _write_channel(parts: list[torch.Tensor]) -> list[Tensors]:
    out = []
    for w in parts:
        scale = _amax_scale(w, dim=-1, keepdim=True)
        out.append({"weight": _fp8(w, scale), "weight_scale": scale})
    return out


def _write_tensor(parts: list[torch.Tensor]) -> list[Tensors]:
    scale = _amax_scale(torch.cat(parts))  # one scale for a fused group, as llm-compressor fuses q/k/v
    return [{"weight": _fp8(w, scale), "weight_scale": scale.reshape(1), "input_scale": torch.tensor([0.02])}
            for w in parts]


def _write_blocks(bn: int, bk: int):
    def write(parts: list[torch.Tensor]) -> list[Tensors]:
        out = []
        for w in parts:
            n, k = w.shape
            rows, cols = -(-n // bn), -(-k // bk)
            padded = torch.zeros(rows * bn, cols * bk)
            padded[:n, :k] = w
            blocks = padded.reshape(rows, bn, cols, bk)
            scale = _amax_scale(blocks, dim=(1, 3))
            q = _fp8(blocks, scale[:, None, :, None]).reshape(rows * bn, cols * bk)[:n, :k].contiguous()
            out.append({"weight": q, "weight_scale_inv": scale})
        return out
    return write


def _dequant_blocks(bn: int, bk: int):
    def dequantize(t: Tensors) -> torch.Tensor:
        w = t["weight"]
        scale = t["weight_scale_inv"].repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        return w.float() * scale[: w.shape[0], : w.shape[1]]
    return dequantize


def _compressed_tensors(weights: str, acts: dict[str, Any]) -> dict[str, Any]:
    w = {"num_bits": 8, "type": "float", "strategy": weights, "dynamic": False, "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w,
                                          "input_activations": {"num_bits": 8, "type": "float", **acts}}},
            "ignore": ["lm_head"]}


def fp8_block_format(bn: int = 16, bk: int = 16) -> QuantFormat:
    """Block-wise FP8 (quant_method "fp8", `weight_scale_inv` per bn x bk block, dynamic 1 x bk inputs)."""
    return QuantFormat(
        f"fp8-block-{bn}x{bk}",
        {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [bn, bk]},
        _write_blocks(bn, bk), _dequant_blocks(bn, bk), _groups(bk), block=(bn, bk), row_tp_tolerance=None)


FP8_FORMATS = (
    QuantFormat("fp8-channel", _compressed_tensors("channel", {"strategy": "token", "dynamic": True}),
                _write_channel, lambda t: t["weight"].float() * t["weight_scale"].float(), _per_token,
                row_tp_tolerance=0.1),  # per-token scales of each rank's half of the input
    QuantFormat("fp8-tensor", _compressed_tensors("tensor", {"strategy": "tensor", "dynamic": False}),
                _write_tensor, lambda t: t["weight"].float() * t["weight_scale"].float(), _static_tensor),
    fp8_block_format(),
)


# -- layer shapes ----------------------------------------------------------------------------------

def _up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class Family:
    """A linear layer shape. kind: "qkv" (hidden, head_dim, heads, kv_heads), "merged" (input,
    [outputs]), "column" or "row" (input, output). tp: whether it splits over two ranks."""

    name: str
    kind: str
    sizes: tuple
    bias: bool = False
    tp: bool = True


def families(block: tuple[int, int]) -> list[Family]:
    """The shape families, every part and tensor-parallel shard whole `block`s (odd sizes otherwise)."""
    bn, bk = block
    hidden, head, inter = _up(40, bk), _up(24, bn), _up(56, 2 * bn)
    return [
        Family("qkv-gqa", "qkv", (hidden, head, 4, 2), bias=True),
        Family("qkv-kv-replicated", "qkv", (hidden, head, 4, 1)),
        Family("gate-up", "merged", (hidden, (inter, inter))),
        Family("down", "row", (_up(inter, 2 * bk), _up(40, bn))),
        Family("o-bias", "row", (_up(96, 2 * bk), _up(40, bn)), bias=True),
        Family("odd-column", "column", (_up(53, bk), 37), tp=False),  # a partial last block
        Family("odd-column-tp", "column", (_up(53, bk), 2 * _up(19, bn))),
        Family("odd-row-tp", "row", (2 * _up(27, bk), 37)),
    ]


def build_layer(family: Family, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1):
    """The core's layer of `family` on rank `tp_rank` of `tp_size` (no process group: the row-parallel
    layer returns its partial sum)."""
    from backplane.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                         RowParallelLinear)
    from backplane.layers.parallel import ParallelContext

    par = ParallelContext(tp_rank=tp_rank, tp_size=tp_size)
    kw = dict(bias=family.bias, parallel=par, params_dtype=dtype)
    if family.kind == "qkv":
        hidden, head, heads, kv = family.sizes
        return QKVParallelLinear(hidden, head, heads, kv, **kw)
    if family.kind == "merged":
        return MergedColumnParallelLinear(family.sizes[0], list(family.sizes[1]), **kw)
    if family.kind == "row":
        return RowParallelLinear(*family.sizes, reduce_results=False, **kw)
    return ColumnParallelLinear(*family.sizes, **kw)


def part_shapes(family: Family) -> tuple[int, list[int], list]:
    """(input size, full output size of each logical part, the loader's shard ids) of `family`."""
    if family.kind == "qkv":
        hidden, head, heads, kv = family.sizes
        return hidden, [heads * head, kv * head, kv * head], ["q", "k", "v"]
    if family.kind == "merged":
        return family.sizes[0], list(family.sizes[1]), list(range(len(family.sizes[1])))
    return family.sizes[0], [family.sizes[1]], [None]


# -- a problem: full-precision weights, written tensors, a layer -------------------------------------

@dataclass
class Problem:
    family: Family
    dtype: torch.dtype
    seed: int = 0
    parts: list[torch.Tensor] = field(default_factory=list)
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        k, sizes, _ = part_shapes(self.family)
        # rows of different magnitudes, so a per-channel scale matters
        self.parts = [torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen).add(0.05) / k**0.5
                      for n in sizes]
        if self.family.bias:
            self.bias = (torch.randn(sum(sizes), generator=gen) * 0.1).to(self.dtype)
        self.gen = gen

    def inputs(self, tokens: int) -> torch.Tensor:
        k = part_shapes(self.family)[0]
        return torch.randn(tokens, k, generator=self.gen).to(self.dtype)


def make_method_layer(spec, family: Family, dtype: torch.dtype, checkpoint_config, tp_rank=0, tp_size=1,
                      device: str = "cpu"):
    """The core's layer handed to the method `spec` builds for `checkpoint_config` (None: online)."""
    config = spec.factory(QuantContext(checkpoint_config=checkpoint_config, dtype=dtype, device=torch.device(device)))
    layer = build_layer(family, dtype, tp_rank, tp_size)
    prefix = f"model.layers.0.{family.name}"
    method = config.method_for(layer, prefix)
    if method is None:
        raise AssertionError(f"{spec.name}: {type(config).__name__}.method_for({prefix!r}) returned None for a "
                             "layer not in its ignore list; expected a QuantMethod")
    layer.set_quant_method(method)
    return layer.to(device)


def load_layer(layer, written: list[Tensors], shard_ids: list, bias: torch.Tensor | None, what: str) -> None:
    """Every written tensor through the layer's weight_loader (each part by its shard id, as the model
    loader does), the bias too; then process_weights_after_loading. Parameters the method registered
    that the checkpoint lacks, and tensors with no parameter, are one-line errors naming them."""
    params = dict(layer.named_parameters(recurse=False))
    loaded = set()
    for tensors, shard_id in zip(written, shard_ids):
        for name, tensor in tensors.items():
            if name not in params:
                raise AssertionError(f"{what}: the checkpoint has {name!r} but create_weights registered no such "
                                     f"parameter (registered: {', '.join(sorted(params))})")
            param = params[name]
            param.weight_loader(param, tensor.to(param.device), shard_id)
            loaded.add(name)
    if bias is not None:
        layer.bias.weight_loader(layer.bias, bias, None)
        loaded.add("bias")
    missing = sorted(set(params) - loaded)
    if missing:
        raise AssertionError(f"{what}: create_weights registered {', '.join(missing)}, which the checkpoint "
                             f"does not have (it has: {', '.join(sorted(loaded))})")
    layer.process_weights_after_loading()


def compare(got: torch.Tensor, want: torch.Tensor, tolerance: float, dtype: torch.dtype, what: str) -> None:
    """max |got - want| <= (tolerance + output rounding of `dtype`) * max |want|, else one line with
    where and by how much."""
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"{what}: output shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    if got.dtype != dtype:
        raise AssertionError(f"{what}: output dtype {got.dtype}, expected the activation dtype {dtype}")
    err = (got.double().cpu() - want.double()).abs()
    if not bool(torch.isfinite(err).all()):
        raise AssertionError(f"{what}: output has NaN or inf")
    scale = max(float(want.abs().max()), 1e-6)
    allowed = (tolerance + DTYPE_ROUNDING.get(dtype, 1e-2)) * scale
    worst = float(err.max())
    if worst > allowed:
        row, col = divmod(int(err.argmax()), err.shape[-1])
        raise AssertionError(
            f"{what}: max |error| {worst:.3g} at token {row}, column {col} (reference {float(want[row, col]):.5g}, "
            f"got {float(got[row, col]):.5g}) exceeds {allowed:.3g} = {tolerance + DTYPE_ROUNDING.get(dtype, 1e-2):.3g}"
            f" x max |reference| {scale:.3g}")


def reference(fmt: QuantFormat, written: list[Tensors], x: torch.Tensor, bias, columns: slice = slice(None)):
    """float64 reference of the format: x as the matmul sees it times the dequantized weight (its
    input `columns` only: a row-parallel rank), plus the bias."""
    w = torch.cat([fmt.dequantize(t) for t in written]).double()[:, columns]
    xq = x.float() if fmt.quantize_input is None else fmt.quantize_input(x.float(), written)
    y = xq.double() @ w.t()
    return y if bias is None else y + bias.double()


# -- the checks ------------------------------------------------------------------------------------

def check_load(spec, fmt: QuantFormat, family: Family, dtype: torch.dtype, device: str = "cpu") -> None:
    """create_weights + loading + process_weights_after_loading + apply against the format's reference."""
    problem = Problem(family, dtype)
    written = fmt.write([w.clone() for w in problem.parts])
    _, _, shard_ids = part_shapes(family)
    what = f"{spec.name} {fmt} {family.name} {str(dtype).removeprefix('torch.')}"
    layer = make_method_layer(spec, family, dtype, fmt.checkpoint_config, device=device)
    load_layer(layer, written, shard_ids, problem.bias, what)
    for tokens in TOKENS:
        x = problem.inputs(tokens)
        got = layer(x.to(device))
        compare(got, reference(fmt, written, x, problem.bias), fmt.tolerance, dtype, f"{what} tokens={tokens}")


def _combine_columns(family: Family, outputs: list[torch.Tensor], full: torch.Tensor, tol, dtype, what) -> None:
    """Each column rank's slice of each part against the one-rank layer's columns it stands for
    (concatenated over ranks; a replicated KV head on every rank)."""
    _, sizes, _ = part_shapes(family)
    tp = len(outputs)
    for rank, out in enumerate(outputs):
        local = [n // tp for n in sizes]
        if family.kind == "qkv" and family.sizes[3] < tp:  # replicated KV heads
            head = family.sizes[1]
            local = [sizes[0] // tp, head, head]
        if out.shape[-1] != sum(local):
            raise AssertionError(f"{what} rank {rank}: output width {out.shape[-1]}, expected {sum(local)}")
        start = 0
        for i, (n_full, n_local) in enumerate(zip(sizes, local)):
            replicas = tp * n_local // n_full
            source = sum(sizes[:i]) + (rank // replicas) * n_local
            compare(out[:, start:start + n_local], full[:, source:source + n_local].double().cpu(), tol, dtype,
                    f"{what} rank {rank} part {i} against the one-rank layer's columns {source}:{source + n_local}")
            start += n_local


def check_tp(spec, fmt: QuantFormat | None, family: Family, dtype: torch.dtype, device: str = "cpu",
             online_tolerance: float = 0.1) -> None:
    """Two tensor-parallel ranks loaded from the same tensors against the one-rank layer (fmt None:
    online quantization of the full-precision weights)."""
    problem = Problem(family, dtype)
    _, _, shard_ids = part_shapes(family)
    if fmt is None:
        written = [{"weight": w.to(dtype)} for w in problem.parts]
        config, tol, row_tol, name = None, online_tolerance, online_tolerance, "online"
    else:
        written = fmt.write([w.clone() for w in problem.parts])
        config, tol, name = fmt.checkpoint_config, fmt.tolerance, fmt.name
        row_tol = fmt.row_tp_tolerance if fmt.row_tp_tolerance is not None else fmt.tolerance
    what = f"{spec.name} {name} {family.name} {str(dtype).removeprefix('torch.')} tp=2"
    layers = []
    for rank, size in ((0, 1), (0, 2), (1, 2)):
        layer = make_method_layer(spec, family, dtype, config, rank, size, device)
        load_layer(layer, written, shard_ids, problem.bias, f"{what} rank {rank}" if size > 1 else what)
        layers.append(layer)
    one, ranks = layers[0], layers[1:]
    for tokens in TOKENS:
        x = problem.inputs(tokens).to(device)
        full = one(x)
        label = f"{what} tokens={tokens}"
        if family.kind != "row":
            _combine_columns(family, [layer(x) for layer in ranks], full, tol, dtype, label)
            continue
        k_local = x.shape[-1] // 2
        outs = []
        for rank, layer in enumerate(ranks):
            cols = slice(rank * k_local, (rank + 1) * k_local)
            out = layer(x[:, cols])
            outs.append(out)
            if fmt is not None:
                want = reference(fmt, written, x[:, cols].cpu(), problem.bias if rank == 0 else None, cols)
                compare(out, want, tol, dtype, f"{label} rank {rank} against the reference over input columns "
                                               f"{cols.start}:{cols.stop}")
        total = (outs[0].double() + outs[1].double()).to(dtype)
        compare(total, full.double().cpu(), row_tol, dtype, f"{label}: the ranks' partial sums against the one-rank layer")


def check_online(spec, family: Family, dtype: torch.dtype, device: str = "cpu", tolerance: float = 0.1) -> None:
    """Full-precision weights quantized by the method after loading: close to the full-precision
    layer, and held in fewer bytes."""
    problem = Problem(family, dtype)
    _, _, shard_ids = part_shapes(family)
    what = f"{spec.name} online {family.name} {str(dtype).removeprefix('torch.')}"
    full_w = torch.cat(problem.parts).to(dtype)
    layer = make_method_layer(spec, family, dtype, None, device=device)
    load_layer(layer, [{"weight": w.to(dtype)} for w in problem.parts], shard_ids, problem.bias, what)
    held = sum(p.numel() * p.element_size() for n, p in layer.named_parameters(recurse=False) if n != "bias")
    held += sum(b.numel() * b.element_size() for b in layer.buffers(recurse=False))
    plain = full_w.numel() * full_w.element_size()
    if held >= plain:
        raise AssertionError(f"{what}: after process_weights_after_loading the layer holds {held} bytes of weights, "
                             f"not fewer than the full-precision weight's {plain}; expected the method to quantize it")
    for tokens in TOKENS:
        x = problem.inputs(tokens)
        want = x.double() @ full_w.double().t()
        if problem.bias is not None:
            want = want + problem.bias.double()
        compare(layer(x.to(device)), want, tolerance, dtype, f"{what} tokens={tokens} against full precision")


def check_selection(spec, plugin: str = "conformance", dtype: torch.dtype = torch.float32, device: str = "cpu",
                    registry=None) -> None:
    """`--quantization auto` picks `spec` for each declared format among the registered methods; by
    name it loads them; online by name works exactly when supports_online is declared. `registry`:
    the installed one, to report which method wins auto there (None: `spec` registered alone)."""
    from backplane.plugin.registry import Registry
    from backplane.plugin.selection import QuantRequirements, SelectionError, select_quant_method

    alone = Registry()
    alone.callback("quant", plugin, None)(spec)
    dtype_name = str(dtype).removeprefix("torch.")
    if not spec.checkpoint_formats and not spec.supports_online:
        raise AssertionError(f"{spec.name}: declares no checkpoint_formats and not supports_online; expected at "
                             "least one way to use it")

    def req(fmt):
        return QuantRequirements(platform=device, dtype=dtype_name, checkpoint_format=fmt)

    for fmt in spec.checkpoint_formats:
        for name in ("auto", spec.name):
            choice = select_quant_method(alone, name, req(fmt))
            if choice is None or choice.spec.name != spec.name:
                got = None if choice is None else choice.spec.name
                raise AssertionError(f"{spec.name}: --quantization {name} for quant_method {fmt!r} chose {got!r}; "
                                     f"expected {spec.name!r} (declared checkpoint_formats: {spec.checkpoint_formats})")
        if registry is not None:
            choice = select_quant_method(registry, "auto", req(fmt))
            if choice.spec.name != spec.name and choice.spec.priority <= spec.priority:
                raise AssertionError(f"{spec.name}: with the installed plugins, --quantization auto for {fmt!r} "
                                     f"chose {choice.spec.name!r} of priority {choice.spec.priority}, not higher than "
                                     f"{spec.name}'s {spec.priority}: {choice.reason}")
    if spec.supports_online:
        choice = select_quant_method(alone, spec.name, req(None))
        if choice is None or choice.spec.name != spec.name:
            raise AssertionError(f"{spec.name}: --quantization {spec.name} of an unquantized checkpoint did not "
                                 "choose it, though it declares supports_online")
    else:
        try:
            select_quant_method(alone, spec.name, req(None))
        except SelectionError:
            pass
        else:
            raise AssertionError(f"{spec.name}: --quantization {spec.name} of an unquantized checkpoint was accepted "
                                 "though it does not declare supports_online")
    if select_quant_method(alone, "auto", req(None)) is not None:
        raise AssertionError("--quantization auto of an unquantized checkpoint chose a method; expected none")


# -- the pytest suite ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    check: str  # "load", "tp", "online", "selection"
    fmt: QuantFormat | None = None
    family: Family | None = None

    def __str__(self) -> str:
        return "-".join(str(p) for p in (self.check, self.fmt, self.family and self.family.name) if p)


def cases(formats: Sequence[QuantFormat], online: bool) -> list[Case]:
    out = [Case("selection")]
    for fmt in formats:
        fams = families(fmt.block)
        out += [Case("load", fmt, f) for f in fams]
        out += [Case("tp", fmt, f) for f in fams if f.tp]
    if online:
        fams = families((1, 1))
        out += [Case("online", None, f) for f in fams]
        out += [Case("tp", None, f) for f in fams if f.tp]
    return out


def applicable(spec, case: Case, device: str, dtype: torch.dtype) -> str | None:
    """Why `case` does not apply to the method of `spec` (None when it does)."""
    if device not in spec.platforms:
        return f"method does not run on {device}"
    dtype_name = str(dtype).removeprefix("torch.")
    if dtype_name not in spec.dtypes:
        return f"dtype {dtype_name} not declared"
    if case.check == "tp" and not spec.supports_tp:
        return "does not declare supports_tp"
    if case.fmt is not None and case.fmt.checkpoint_config.get("quant_method") not in spec.checkpoint_formats:
        return f"format {case.fmt}: quant_method {case.fmt.checkpoint_config.get('quant_method')!r} not declared"
    return None


def run_case(spec, case: Case, device: str, dtype: torch.dtype, online_tolerance: float = 0.1, plugin="conformance",
             registry=None) -> None:
    if case.check == "selection":
        return check_selection(spec, plugin, dtype, device, registry)
    if case.check == "load":
        return check_load(spec, case.fmt, case.family, dtype, device)
    if case.check == "online":
        return check_online(spec, case.family, dtype, device, online_tolerance)
    return check_tp(spec, case.fmt, case.family, dtype, device, online_tolerance)


def default_dtypes(device: str) -> list[torch.dtype]:
    return [torch.bfloat16] if device == "cuda" else [torch.float32, torch.bfloat16]


def make_suite(method, formats: Sequence[QuantFormat] = (), device: str | None = None,
               dtype: torch.dtype | None = None, plugins=(), online_tolerance: float = 0.1):
    """A pytest test function parametrized over every conformance case and dtype.

    method: a registered method's name, or a QuantMethodSpec (not registered: checked as is, and
    registered alone for the selection case). formats: the checkpoint writers of its formats
    (`FP8_FORMATS` for the standard FP8 ones); a format whose quant_method the spec does not declare
    is skipped. device: cuda when available, else cpu; dtype: bf16 on cuda, fp32 and bf16 on cpu;
    plugins: plugin objects to register besides the installed ones; online_tolerance: allowed
    max |error| / max |output| of online quantization against full precision.
    """
    import pytest

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtypes = [dtype] if dtype else default_dtypes(device)
    declared_online = method.supports_online if not isinstance(method, str) else _spec(method, plugins)[0].supports_online
    all_cases = cases(formats, declared_online)

    @pytest.mark.parametrize("dtype", dtypes, ids=lambda d: str(d).removeprefix("torch."))
    @pytest.mark.parametrize("case", all_cases, ids=str)
    def test_quant_conformance(case, dtype):
        spec, plugin, registry = _spec(method, plugins)
        reason = spec.available() or applicable(spec, case, device, dtype)
        if reason:
            pytest.skip(f"{spec.name}: {reason}")
        run_case(spec, case, device, dtype, online_tolerance, plugin, registry)

    return test_quant_conformance


def _spec(method, plugins=()):
    """(spec, its plugin's name, the installed registry or None) of a name or a spec."""
    if not isinstance(method, str):
        return method, "conformance", None
    from backplane.plugin.manager import load_plugins

    registry = load_plugins(extra=plugins).registry
    regs = registry.registrations("quant", method)
    if not regs:
        names = sorted({r.item.name for r in registry.registrations("quant")})
        raise LookupError(f"quantization method {method!r} is not registered; registered: {', '.join(names) or 'none'}")
    return regs[0].item, regs[0].plugin, registry


__all__ = ["FP8_FORMATS", "Case", "Family", "QuantFormat", "applicable", "build_layer", "cases", "check_load",
           "check_online", "check_selection", "check_tp", "families", "fp8_block_format", "load_layer",
           "make_method_layer", "make_suite", "run_case"]
