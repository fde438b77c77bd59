"""EngineArgs: the one typed settings model behind the CLI, the Python API and BACKPLANE_* env vars.

Every field is a kebab-case flag (`max_running_requests` -> `--max-running-requests`) and an env
var (`BACKPLANE_MAX_RUNNING_REQUESTS`). Plugin option groups registered through
`backplane_register_settings` become `--<group>.<option>` and `BACKPLANE_<GROUP>__<OPTION>`.
Command-line values win over the environment. An empty env var is unset. A list in an env var is
JSON (`["a=x","b=y"]`, `[1,2,4]`) or, when it does not start with `[`, comma or space separated.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

ENV_PREFIX = "BACKPLANE_"
# Read before settings exist (they decide which plugins load, and so which flags exist).
ENV_PLUGINS = "BACKPLANE_PLUGINS"
ENV_STRICT_PLUGINS = "BACKPLANE_STRICT_PLUGINS"
# Tests only: "RANK" or "RANK:STAGE" (STAGE start or forward) makes that tensor-parallel worker
# raise at that point, to show that the engine then fails with the rank and cause, without hanging.
ENV_TEST_FAIL_RANK = "BACKPLANE_TEST_FAIL_RANK"


# Lists in env vars are JSON, or written "a,b,c" (or space separated); see _split_env_list.
StrList = Annotated[list[str], NoDecode]
IntList = Annotated[list[int], NoDecode]


MAX_DEFAULT_CPU_THREADS = 16
SMALL_MATRIX = 1 << 20  # weight elements; below it, one CPU thread (measured on tiny-llama: README, docs/performance.md)
# speculative_* options that only take effect with --speculative-algorithm.
SPECULATIVE_OPTIONS = ("speculative_draft_model", "speculative_num_steps", "speculative_eagle_topk",
                       "speculative_num_draft_tokens", "speculative_token_map")


class SettingsError(ValueError):
    """A bad setting; the message is one line naming the flag, the env var, the value and what is allowed."""


class EngineArgs(BaseSettings):
    """Every option of the executor. See `backplane generate --help` for the flag of each."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True,
                                      env_ignore_empty=True)

    # Model and device
    model: str = Field("tiny-llama", description="a local Hugging Face directory or a preset name")
    load_format: Literal["auto", "safetensors", "dummy"] = Field(
        "auto", description="auto: dummy for a preset, safetensors for a directory"
    )
    tokenizer_path: str | None = Field(None, description="tokenizer directory (default: the model's)")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="auto: bfloat16 on cuda, float32 on cpu"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available")
    seed: int = Field(0, ge=0, le=2**64 - 1, description="seed for dummy weights and sampling")
    context_length: int | None = Field(None, ge=1, description="max tokens per request")
    tp_size: int = Field(1, ge=1, description="tensor-parallel size")
    cpu_threads: int | None = Field(
        None, ge=1, description="torch threads on CPU (default: OMP_NUM_THREADS when set, else 1 for a model "
        f"whose largest weight matrix is under {SMALL_MATRIX:,} elements, else the cores this process may use, "
        f"at most {MAX_DEFAULT_CPU_THREADS})")
    # Quantization (issue 39)
    quantization: str = Field(
        "auto", description="registered quantization method (NAME or NAME@PLUGIN), auto (follow the checkpoint's "
        "quantization_config; a bf16 checkpoint stays bf16) or none")
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8"] = Field(
        "auto", description="KV cache dtype: auto (the model dtype) or fp8_e4m3 (per-tensor k/v scales; fp8 is "
        "accepted as its alias, as vLLM spells it)")
    # Backends
    attention_backend: str = Field("auto", description="registered attention backend (NAME or NAME@PLUGIN) or auto")
    prefill_attention_backend: str | None = Field(None, description="default: --attention-backend")
    decode_attention_backend: str | None = Field(None, description="default: --attention-backend")
    moe_backend: str = Field(
        "auto", description="registered MoE backend (NAME or NAME@PLUGIN) or auto, for mixture-of-experts models "
        "(unused by a dense model)")
    custom_ops: StrList = Field(default_factory=list, description="overrides such as rms_norm=native")
    strict_plugins: bool = Field(False, description="a plugin that fails to load is fatal")
    # LoRA
    lora_paths: StrList = Field(default_factory=list, description="adapters as name=path")
    lora_backend: str = Field("auto", description="registered LoRA backend (NAME or NAME@PLUGIN) or auto")
    max_loras_per_batch: int = Field(8, ge=1, description="adapter slots on the device")
    max_lora_rank: int | None = Field(None, ge=1, description="default: the largest adapter's rank")
    # Speculative decoding
    speculative_algorithm: str | None = Field(None, description="a registered algorithm (`backplane plugins` lists them)")
    speculative_draft_model: str | None = Field(None, description="deprecated until 0.3: use --eagle.draft-model")
    speculative_num_steps: int = Field(3, ge=1, description="deprecated until 0.3: use --eagle.num-steps")
    speculative_eagle_topk: int = Field(1, ge=1, description="deprecated until 0.3: use --eagle.topk")
    speculative_num_draft_tokens: int = Field(4, ge=1, description="draft tokens verified per step")
    speculative_token_map: str | None = Field(
        None, description="deprecated until 0.3: use --eagle.token-map")
    # CUDA graphs and compilation
    cuda_graph_bs: IntList | None = Field(None, description="batch sizes to capture")
    cuda_graph_max_bs: int = Field(160, ge=1, description="largest batch size to capture")
    disable_cuda_graph: bool = Field(False, description="run decode eagerly")
    disable_cuda_graph_padding: bool = Field(
        False, description="replay graphs only at exactly captured batch sizes (default ladder 1..32, 64, 128); "
        "other sizes run eagerly")
    # Extend graphs are on by default since 2026-12-07: full capture (triton, flashinfer) and piecewise
    # capture (torch_native) replayed equal to eager in their GPU tests and the GPU matrix (docs/reliability.md).
    disable_extend_graph: bool = Field(
        False, description="run prefill and extend batches eagerly (decode and verify graphs stay)")
    cuda_graph_max_tokens: int | None = Field(
        None, ge=1, description="largest token bucket of the extend graphs (default: 512, at most "
        "--chunked-prefill-size); larger prefills run eagerly")
    cuda_graph_max_extend_bs: int = Field(8, ge=1, description="most requests in one captured extend batch")
    enable_torch_compile: bool = Field(False, description="torch.compile small batch sizes")
    torch_compile_max_bs: int = Field(32, ge=1, description="largest batch size to compile")
    # Memory and scheduling
    disable_overlap_schedule: bool = Field(
        False, description="read each step's tokens before building the next (no host/device overlap)")
    mem_fraction_static: float = Field(0.85, gt=0, lt=1, description="device memory for weights+KV")
    max_total_tokens: int | None = Field(None, ge=1, description="KV pool size in tokens")
    max_running_requests: int | None = Field(None, ge=1, description="requests decoded at once")
    chunked_prefill_size: int = Field(8192, ge=1, description="max new tokens in one prefill batch")
    disable_radix_cache: bool = Field(False, description="do not reuse the KV of shared prompt prefixes")
    gc_freeze: bool = Field(
        False, description="after startup, move every live object to the garbage collector's permanent "
        "generation (gc.freeze): full collections then skip them (~0.1 s each otherwise); for a process that "
        "runs this engine until shutdown(), which unfreezes (backplane serve's processes always freeze)")
    log_level: Literal["debug", "info", "warning", "error"] = Field("warning", description="logging")
    # Plugin option groups, filled from --<group>.<option> and BACKPLANE_<GROUP>__<OPTION>.
    plugin_options: dict[str, Any] = Field(default_factory=dict, exclude=True)

    @field_validator("kv_cache_dtype", mode="before")
    @classmethod
    def _kv_cache_alias(cls, value: Any) -> Any:
        return "fp8_e4m3" if value == "fp8" else value  # vLLM's name of the same e4m3 cache

    @field_validator("custom_ops", "lora_paths", "cuda_graph_bs", mode="before")
    @classmethod
    def _split_env_list(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        if value.lstrip().startswith("["):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"expected a JSON list or comma-separated values, got a JSON error: {exc}") from None
            if not isinstance(parsed, list):
                raise ValueError(f"expected a JSON list, got {type(parsed).__name__}")
            return [item if isinstance(item, (int, str)) else str(item) for item in parsed]
        return [item for item in value.replace(",", " ").split() if item]

    @field_validator("model")
    @classmethod
    def _check_model(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("expected a preset name or a local model directory, got an empty string")
        return value

    @model_validator(mode="after")
    def _check_speculative_options(self) -> EngineArgs:
        if self.speculative_algorithm:
            return self
        changed = [f for f in SPECULATIVE_OPTIONS if getattr(self, f) != type(self).model_fields[f].default]
        if changed:
            given = ", ".join(f"{flag_name(f)} {getattr(self, f)!r}" for f in changed)
            raise ValueError(f"{changed[0]}: {given} take effect only with --speculative-algorithm; expected "
                             "--speculative-algorithm NAME (a registered algorithm) or none of these flags")
        return self

    @field_validator("cuda_graph_bs")
    @classmethod
    def _check_graph_bs(cls, value: list[int] | None) -> list[int] | None:
        if value is None:
            return value
        if not value or any(b < 1 for b in value):
            raise ValueError("expected positive batch sizes")
        if len(set(value)) != len(value):
            raise ValueError("expected distinct batch sizes, got duplicates")
        return sorted(value)

    @field_validator("lora_paths")
    @classmethod
    def _check_lora_paths(cls, value: list[str]) -> list[str]:
        names = [_split_pair(item, "name=path")[0] for item in value]
        if len(set(names)) != len(names):
            raise ValueError("expected distinct adapter names")
        return value

    @field_validator("custom_ops")
    @classmethod
    def _check_custom_ops(cls, value: list[str]) -> list[str]:
        for item in value:
            _split_pair(item, "op=implementation")
        return value

    @property
    def lora_path_map(self) -> dict[str, str]:
        return dict(_split_pair(item, "name=path") for item in self.lora_paths)

    @property
    def custom_op_overrides(self) -> dict[str, str]:
        return dict(_split_pair(item, "op=implementation") for item in self.custom_ops)

    def options_for(self, group: str) -> Any:
        """The parsed option model of a plugin group (None when the group is not registered)."""
        return self.plugin_options.get(group)


# NOTE: deprecated name from before the HTTP server (whose own flags are ServeArgs); kept so code
# written against it, in this tree (engine/, server/, speculative/ docstrings) and outside, still works.
ServerArgs = EngineArgs


def _split_pair(item: str, shape: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not name or not value:
        raise ValueError(f"expected {shape}, got {item!r}")
    return name, value


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str, group: str | None = None) -> str:
    if group:
        return f"{ENV_PREFIX}{group.replace('-', '_').upper()}__{field.upper()}"
    return ENV_PREFIX + field.upper()


def format_validation_error(err: ValidationError, group: str | None = None, fields: tuple[str, ...] = ()) -> str:
    """One line: the flag, its env var, the value received and what is allowed.

    An error of the whole model (a validator across options) has no field of its own: it is put on
    the first of `fields` that its message names, else on the group as a whole.
    """
    first = err.errors()[0]
    message = first["msg"].removeprefix("Value error, ")
    value = first.get("input")
    if first["loc"]:
        field = str(first["loc"][0])
    else:
        named = sorted((message.find(f), f) for f in fields if f in message)
        if not named:
            where = f"--{group}.*" if group else "server arguments"
            return f"{where}: invalid combination: {message}"
        field = named[0][1]
        value = value.get(field) if isinstance(value, dict) else value
        message = message.removeprefix(f"{group}.{field}: ").removeprefix(f"{field}: ")
    flag = f"--{group}.{field.replace('_', '-')}" if group else flag_name(field)
    return f"{flag} (env {env_name(field, group)}): invalid value {value!r}: {message}"


def build_server_args(cli_values: dict[str, Any], group_models: dict[str, type] | None = None,
                      group_values: dict[str, dict[str, Any]] | None = None) -> EngineArgs:
    """Validate CLI values over the environment; raise SettingsError with a one-line message."""
    try:
        args = EngineArgs(**cli_values)
    except ValidationError as err:
        raise SettingsError(format_validation_error(err, fields=tuple(EngineArgs.model_fields))) from None
    args.plugin_options = build_plugin_options(group_models or {}, group_values or {})
    return args


def build_plugin_options(group_models: dict[str, type], group_values: dict[str, dict[str, Any]]) -> dict:
    """Instantiate each plugin group's model from env vars overlaid by CLI values."""
    options = {}
    for group, model in group_models.items():
        values = {**_group_env_values(group, model), **group_values.get(group, {})}
        try:
            options[group] = model(**values)
        except ValidationError as err:
            raise SettingsError(format_validation_error(err, group, tuple(model.model_fields))) from None
    unknown = set(group_values) - set(group_models)
    if unknown:
        raise SettingsError(
            f"--{sorted(unknown)[0]}.*: unknown option group; registered: {', '.join(sorted(group_models)) or 'none'}"
        )
    return options


def _group_env_values(group: str, model: type) -> dict[str, Any]:
    values = {}
    for field in model.model_fields:
        raw = os.environ.get(env_name(field, group))
        if raw:  # an empty variable is unset
            values[field] = raw
    return values


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def resolve_cpu_threads(args: EngineArgs, largest_matrix: int | None = None) -> tuple[int, str]:
    """(torch threads for CPU work, where the number came from): --cpu-threads, else OMP_NUM_THREADS,
    else one thread for a model whose largest weight matrix has fewer than SMALL_MATRIX elements
    (`largest_matrix`, when known: splitting such GEMMs costs more than it gives, and spinning
    threads collapse when other work shares the cores), else the cores this process may run on
    (sched_getaffinity), at most MAX_DEFAULT_CPU_THREADS."""
    if args.cpu_threads:
        return args.cpu_threads, "--cpu-threads"
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp), "OMP_NUM_THREADS"
    if largest_matrix is not None and largest_matrix < SMALL_MATRIX:
        return 1, f"a small model: its largest weight matrix has {largest_matrix:,} elements"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_DEFAULT_CPU_THREADS)), f"{cores} cores available to this process"
