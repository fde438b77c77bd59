"""Reading `quantization_config` into an Fp8Scheme: which scales the checkpoint holds and how the
activations are quantized. Anything quant_fp8 cannot load is one ValueError line naming the field.

quant_method: "compressed-tensors"; "fp8" (block-wise or per-tensor); "fbgemm_fp8" (Meta: per-channel
weight_scale [N, 1], per-token activations whose row max is bounded by activation_scale_ub); "modelopt"
(NVIDIA ModelOpt, quant_algo FP8: per-tensor weight_scale and static input_scale).
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any

import torch

from backplane.contracts import ExpertQuant, QuantConfig
from backplane.plugins.quant_fp8.options import BUNDLED, TableSource
from backplane.plugins.quant_fp8.scheme import Fp8Scheme

WEIGHT_STRATEGIES = ("tensor", "channel", "block")
ACTIVATION_STRATEGIES = ("tensor", "token", "group")
FBGEMM_SCALE_UB = 1200.0  # transformers' FbgemmFp8Config default activation_scale_ub
MODELOPT_ALGOS = ("FP8",)  # ModelOpt's quant_algo values quant_fp8 loads (NVFP4, INT4_AWQ, ... are other methods)
MODELOPT = Fp8Scheme(weights="tensor", activations="tensor", static_input=True)


ONLINE = Fp8Scheme(weights="channel", activations="token", online=True)


def online_block(block: tuple[int, int]) -> Fp8Scheme:
    """`--fp8.online-block`: a bf16 checkpoint quantized to (rows, columns) weight blocks after loading,
    activations per 1 x columns group (the block-wise checkpoints' scheme, made online)."""
    return Fp8Scheme(weights="block", activations="group", block=block, online=True)


class Fp8Config(QuantConfig):
    """One scheme for every linear layer the core does not keep in high precision; `table`: where the
    CUDA kernels' launches come from (`--fp8.configs`, `--fp8.tuned`)."""

    name = "fp8"

    def __init__(self, scheme: Fp8Scheme, ignore: tuple[str, ...] = (), table: TableSource = BUNDLED):
        self.scheme = scheme
        self._ignore = tuple(ignore)
        self.table = table

    def __repr__(self) -> str:
        table = "" if self.table == BUNDLED else f", table={self.table}"
        return f"Fp8Config({self.scheme}, ignore={self._ignore}{table})"

    @property
    def ignore(self) -> tuple[str, ...]:
        return self._ignore

    def method_for(self, layer, prefix: str):
        from backplane.plugins.quant_fp8.method import Fp8LinearMethod

        return Fp8LinearMethod(self.scheme, prefix, self.table)

    def expert_quant(self, layer, prefix: str) -> ExpertQuant:
        """The experts of MoE layer `prefix` under this scheme: block scales with 1 x bk activation
        groups, or one scale per output row (per-channel scales; a per-tensor checkpoint's scale fills
        its projection's rows; online: quantized per channel) with per-token activations."""
        return expert_quant_of(self.scheme, prefix)


def expert_quant_of(scheme: Fp8Scheme, prefix: str) -> ExpertQuant:

    if scheme.activation_scale_ub is not None:
        raise ValueError(f"quant_fp8: MoE layer {prefix}: per-token activations bounded by activation_scale_ub "
                         f"{scheme.activation_scale_ub} (fbgemm_fp8) are not supported by the MoE experts; expected "
                         "unbounded dynamic activations")
    if scheme.static_input or scheme.activations == "none":
        what = "static input_scale" if scheme.static_input else "weight-only (no input_activations)"
        raise ValueError(f"quant_fp8: MoE layer {prefix}: {what} FP8 experts are not supported; expected dynamic "
                         "activations (per token, or per 1 x block group)")
    if scheme.weights == "block":
        return ExpertQuant(method="fp8", weight_dtype=torch.float8_e4m3fn, scales="block", activations="group",
                           block=scheme.block, scale_name=scheme.scale_name, online=scheme.online)
    return ExpertQuant(method="fp8", weight_dtype=torch.float8_e4m3fn, scale_name=scheme.scale_name,
                       online=scheme.online)


def make_config(ctx) -> Fp8Config:
    """The Fp8Config of a QuantContext: online for a bf16 checkpoint, else by quant_method; its launch
    table from the options (a `--fp8.configs` file is read, and refused in one line, here)."""
    config = _scheme_config(ctx)
    config.table = launch_table(ctx.options)
    return config


def launch_table(options) -> TableSource:
    """The TableSource of the Fp8Options `options` (None: the bundled table)."""
    if options is None:
        return BUNDLED
    if options.configs is None:
        return TableSource(tuned=options.tuned, pdl=options.pdl)
    from backplane.plugins.quant_fp8.cuda import table_source  # NOTE: reading a table takes triton

    return table_source(options.configs, options.tuned, options.pdl)


def _scheme_config(ctx) -> Fp8Config:
    qc = ctx.checkpoint_config
    block = ctx.options.block if ctx.options is not None else None
    if qc is None:
        scheme = ONLINE if block is None else online_block(block)
        _check_block_for_device(scheme, torch.device(ctx.device))
        return Fp8Config(scheme)
    if block is not None:
        raise ValueError(f"--fp8.online-block {ctx.options.online_block}: quantizes a bf16 checkpoint online, but this "
                         f"checkpoint is already quantized (quantization_config quant_method "
                         f"{qc.get('quant_method')!r}); expected no --fp8.online-block with it")
    method = qc.get("quant_method")
    if method == "fp8":
        config = Fp8Config(_fp8_scheme(qc), _names(qc, "modules_to_not_convert") + _names(qc, "ignored_layers"))
    elif method == "fbgemm_fp8":
        config = Fp8Config(_fbgemm_scheme(qc), _names(qc, "modules_to_not_convert"))
    elif method == "modelopt":
        config = _modelopt_config(qc)
    else:
        config = Fp8Config(_compressed_tensors_scheme(qc), _names(qc, "ignore"))
    _check_block_for_device(config.scheme, torch.device(ctx.device))
    return config


MIN_CUDA_BLOCK_COLUMNS = 32  # Triton's 8-bit tl.dot on CUDA takes K >= 32; the block kernels step K by a block


def _check_block_for_device(scheme: Fp8Scheme, device: torch.device) -> None:
    """Refuse, before any weight loads, block-wise weights whose blocks are narrower than the CUDA
    kernels' K step (the CPU path dequantizes and takes any block)."""
    if device.type == "cuda" and scheme.weights == "block" and scheme.block[1] < MIN_CUDA_BLOCK_COLUMNS:
        raise ValueError(f"quantization_config weight block {list(scheme.block)}: the CUDA FP8 kernels need blocks of "
                         f"at least {MIN_CUDA_BLOCK_COLUMNS} columns (checkpoints of [128, 128] blocks load); "
                         "fix: --device cpu, or requantize with wider blocks")


def _names(qc: dict[str, Any], key: str, where: str = "quantization_config") -> tuple[str, ...]:
    value = qc.get(key) or ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}.{key} = {value!r}: expected a list of module names")
    return tuple(value)


def _block(value: Any, field: str) -> tuple[int, int]:
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)
    if not ok:
        raise ValueError(f"quantization_config.{field} = {value!r}: expected [rows, columns] of a weight block, "
                         "two integers > 0 (e.g. [128, 128])")
    return int(value[0]), int(value[1])


def _fp8_scheme(qc: dict[str, Any]) -> Fp8Scheme:
    """The "fp8" format (transformers' FineGrainedFP8 / vLLM's Fp8Config checkpoints)."""
    act = qc.get("activation_scheme", "dynamic")
    if act not in ("dynamic", "static"):
        raise ValueError(f"quantization_config.activation_scheme = {act!r}: expected 'dynamic' or 'static'")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt = {fmt!r}: quant_fp8 loads float8 e4m3 weights only (expected 'e4m3')")
    if qc.get("weight_block_size") is None:
        return Fp8Scheme(weights="tensor", activations="tensor", static_input=act == "static")
    if act == "static":
        raise ValueError("quantization_config: activation_scheme 'static' with weight_block_size: block-wise FP8 "
                         "quantizes activations dynamically per 1 x block group; expected activation_scheme 'dynamic'")
    return Fp8Scheme(weights="block", activations="group", block=_block(qc["weight_block_size"], "weight_block_size"),
                     scale_name="weight_scale_inv")


def _fbgemm_scheme(qc: dict[str, Any]) -> Fp8Scheme:
    """Meta's fbgemm_fp8 (transformers' FbgemmFp8Config): weight_scale [N, 1] per channel; each token
    quantized with scale min(max |x|, activation_scale_ub) / 448, larger values saturating."""
    ub = qc.get("activation_scale_ub", FBGEMM_SCALE_UB)
    if isinstance(ub, bool) or not isinstance(ub, (int, float)) or not math.isfinite(ub) or ub <= 0:
        raise ValueError(f"quantization_config.activation_scale_ub = {ub!r}: expected a number > 0, the bound on "
                         f"each token's max |x| (transformers' default {FBGEMM_SCALE_UB})")
    return Fp8Scheme(weights="channel", activations="token", activation_scale_ub=float(ub))


def _modelopt_config(qc: dict[str, Any]) -> Fp8Config:
    """NVIDIA ModelOpt, quant_algo FP8. Its fields sit in quantization_config itself or, as in the
    hf_quant_config.json of older exports, under "quantization". exclude_modules (or "ignore") are
    ModelOpt's wildcards over the whole module name ("*" spans dots), or plain names."""
    nested = "quantization" in qc
    fields, where = (qc["quantization"], "quantization_config.quantization") if nested else (qc, "quantization_config")
    if not isinstance(fields, dict):
        raise ValueError(f"{where} = {fields!r}: expected an object with quant_algo, kv_cache_quant_algo, exclude_modules")
    algo = fields.get("quant_algo")
    if not isinstance(algo, str) or algo.upper() not in MODELOPT_ALGOS:
        raise ValueError(f"{where}.quant_algo = {algo!r}: quant_fp8 loads ModelOpt FP8 checkpoints (per-tensor weight "
                         f"and static input scales); expected one of: {', '.join(MODELOPT_ALGOS)}")
    _check_modelopt_kv_cache(fields, where)
    patterns = _names(fields, "exclude_modules", where) + _names(fields, "ignore", where)
    return Fp8Config(MODELOPT, tuple(_wildcard(p) for p in patterns))


def _check_modelopt_kv_cache(fields: dict[str, Any], where: str) -> None:
    """An FP8 KV cache (its k_scale / v_scale load with the weights) or none; anything else is refused."""
    algo = fields.get("kv_cache_quant_algo")
    if algo is not None and (not isinstance(algo, str) or algo.upper() != "FP8"):
        raise ValueError(f"{where}.kv_cache_quant_algo = {algo!r}: expected 'FP8' or null (the only KV cache "
                         "quantization backplane serves)")
    scheme = fields.get("kv_cache_scheme")
    if scheme is not None and not (isinstance(scheme, dict) and scheme.get("type") == "float"
                                   and scheme.get("num_bits") == 8):
        raise ValueError(f"{where}.kv_cache_scheme = {scheme!r}: expected an 8-bit float KV cache (type float, "
                         "num_bits 8) or none")


def _wildcard(pattern: str) -> str:
    """A ModelOpt exclude pattern as a core ignore pattern: a wildcard becomes "re:" and its regular
    expression (matched against the whole name); a plain name stays one."""
    return f"re:{fnmatch.translate(pattern)}" if any(c in pattern for c in "*?[") else pattern


def _compressed_tensors_scheme(qc: dict[str, Any]) -> Fp8Scheme:
    fmt = qc.get("format", "float-quantized")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"quantization_config.format = {fmt!r}: quant_fp8 loads 'float-quantized' (or "
                         "'naive-quantized') compressed-tensors checkpoints")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"quantization_config.config_groups = {groups!r}: expected an object of quantization groups")
    schemes = {name: _group_scheme(name, group) for name, group in groups.items()}
    if len(set(schemes.values())) > 1:
        raise ValueError(f"quantization_config.config_groups: groups {', '.join(schemes)} differ; quant_fp8 "
                         "loads one scheme for every linear layer")
    return next(iter(schemes.values()))


def _group_scheme(name: str, group: Any) -> Fp8Scheme:
    where = f"quantization_config.config_groups.{name}"
    if not isinstance(group, dict):
        raise ValueError(f"{where}: expected an object with targets, weights, input_activations")
    targets = group.get("targets") or []
    if list(targets) != ["Linear"]:
        raise ValueError(f"{where}.targets = {targets!r}: quant_fp8 loads groups targeting ['Linear']")
    weights = _float8(group.get("weights"), f"{where}.weights", WEIGHT_STRATEGIES)
    if weights.get("dynamic"):
        raise ValueError(f"{where}.weights.dynamic = true: expected static weight scales")
    block = None
    if weights["strategy"] == "block":
        block = _block(weights.get("block_structure"), f"config_groups.{name}.weights.block_structure")
    acts = group.get("input_activations")
    if acts is None:
        return Fp8Scheme(weights=weights["strategy"], activations="none", block=block)
    acts = _float8(acts, f"{where}.input_activations", ACTIVATION_STRATEGIES)
    strategy, dynamic = acts["strategy"], bool(acts.get("dynamic"))
    if strategy in ("token", "group") and not dynamic:
        raise ValueError(f"{where}.input_activations: strategy {strategy!r} with dynamic false: expected dynamic true")
    if strategy == "group" and (block is None or acts.get("group_size") != block[1]):
        raise ValueError(f"{where}.input_activations: strategy 'group' needs block weights whose columns equal "
                         f"group_size; got group_size {acts.get('group_size')!r}, weight block {block}")
    return Fp8Scheme(weights=weights["strategy"], activations=strategy, static_input=strategy == "tensor" and not dynamic,
                     block=block)


def _float8(args: Any, where: str, strategies: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(args, dict):
        raise ValueError(f"{where}: expected an object (num_bits, type, strategy)")
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise ValueError(f"{where}: num_bits {args.get('num_bits')!r}, type {args.get('type')!r}: quant_fp8 loads "
                         "8-bit float only (expected num_bits 8, type 'float')")
    if args.get("strategy") not in strategies:
        raise ValueError(f"{where}.strategy = {args.get('strategy')!r}: expected one of {', '.join(strategies)}")
    if args.get("symmetric") is False:
        raise ValueError(f"{where}.symmetric = false: FP8 scales are symmetric; expected true")
    return args
