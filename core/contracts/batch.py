"""ForwardMode and ForwardBatch: what one forward pass of the model runner receives.

A ForwardBatch carries device tensors for the kernels and host copies of the small per-request
vectors so that backends can plan on the host without a device synchronisation.
"""

from __future__ import annotations

import ctypes
import enum
import inspect
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:
    from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool


@dataclass
class HostBatch:
    """The host copies of a ForwardBatch's token and request vectors, kept by the batch builder.

    input_ids, positions, out_cache_loc: [num_tokens] int64; req_pool_indices: [batch_size] int64.
    input_ids are the ids as built: a token still in flight under overlap scheduling is its
    negative placeholder (the device copy is resolved, this one is not). prefix_parts: a
    prefill's only (EXTEND, or the DECODE batch of one-token prefills), (slot tensors, prefix
    length) of each request with a cached prefix, from the host record
    `req.slots`; `prefix_slots` joins them only when asked (tensor parallelism), so a single-device
    prefill pays nothing for it. Reading these never waits for the device, which is why tensor
    parallelism sends them (backplane.distributed.batch_sync), and why the graph runner pads a
    replay from them: positions, out_cache_loc, req_pool_indices (and input_ids but placeholders)
    must hold the values of the batch's device tensors.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    prefix_parts: list[tuple[list[torch.Tensor], int]] = field(default_factory=list)

    @property
    def prefix_slots(self) -> torch.Tensor | None:
        """[sum prefix] int64: req_to_token[row, :prefix_len] of every request with a prefix, request
        after request, or None when none has one."""
        parts = [torch.cat(slots)[:n] for slots, n in self.prefix_parts]
        return torch.cat(parts) if parts else None

    @property
    def has_placeholders(self) -> bool:
        """Whether some input id is a placeholder for a token still on the device."""
        return bool(self.input_ids.numel()) and int(self.input_ids.min()) < 0


def host_bytes(tensor: torch.Tensor, dtype: torch.dtype) -> bytes:
    """The values of host tensor `tensor` as `dtype`, in order, as their bytes. A contiguous CPU
    tensor of `dtype` (the batch builder's host copies, seq_lens_cpu) is read from its memory by
    no torch operator; any other goes through a converted copy."""
    if tensor.dtype is not dtype or not tensor.is_cpu or not tensor.is_contiguous():
        tensor = tensor.to("cpu", dtype).contiguous()
    size = tensor.nbytes
    return ctypes.string_at(tensor.data_ptr(), size) if size else b""


class ForwardMode(enum.Enum):
    """The kind of forward pass; attention backends declare which ones they serve."""

    EXTEND = "extend"  # prefill: new tokens attend to a cached prefix and causally to each other
    DECODE = "decode"  # one new token per request
    TARGET_VERIFY = "target_verify"  # draft tokens checked by the target model under a tree mask
    DRAFT_EXTEND = "draft_extend"  # the draft model extends over the accepted tokens

    @property
    def is_extend_like(self) -> bool:
        """Modes served by `AttentionBackend.forward_extend`."""
        return self in (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass(kw_only=True)
class ForwardBatch:
    """One forward pass over `batch_size` requests.

    Token-level tensors are flattened over the batch in request order:
      input_ids, positions, out_cache_loc: [num_tokens]
    Request-level tensors:
      req_pool_indices: [batch_size] int64, the request's row in `req_to_token_pool`
      seq_lens: [batch_size] int32, the total length after this pass (prefix + new tokens)
      extend_prefix_lens / extend_seq_lens: [batch_size] int32, tokens already cached / new now
      extend_indptr: [batch_size + 1] int32 or None: 0, then the running sum of extend_seq_lens
        (request b's new tokens are rows extend_indptr[b]:extend_indptr[b + 1]); set where it comes
        without device work (the graph runner's padded EXTEND batches), else None
    The scheduler writes `req_to_token[req, prefix:prefix+new] = out_cache_loc[...]` before the
    forward, so a backend may read every key of a request through `req_to_token`. Backends write
    the new K/V at `out_cache_loc` themselves.

    For TARGET_VERIFY (and any extend with `custom_mask`): `custom_mask` is a flat bool tensor
    holding, request after request, a row-major [extend_len, seq_len] mask over all keys of the
    request (prefix included); `mask_indptr` [batch_size + 1] gives where each request starts.

    A ForwardBatch holds the forward's inputs only, built by keyword. What the forward runs with
    (backend, LoRA binding, op table, hidden-state capture, logits buffer) is its ForwardContext
    (backplane.contracts.forward_context), which the model runner binds for the forward alone.
    `plugin_inputs` carries what scheduler participants describe of the batch, by name (LoRA:
    "lora" -> the requests' segments and slots): host data, shipped as is to tensor-parallel ranks.
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    extend_prefix_lens: torch.Tensor | None = None
    extend_seq_lens: torch.Tensor | None = None
    extend_prefix_lens_cpu: torch.Tensor | None = None
    extend_seq_lens_cpu: torch.Tensor | None = None
    extend_indptr: torch.Tensor | None = None
    custom_mask: torch.Tensor | None = None
    mask_indptr: torch.Tensor | None = None
    spec_info: Any = None
    return_logprob: bool = False
    # Which tokens' hidden states go to the logits layer (default: the last of each request).
    logits_indices: torch.Tensor | None = None
    # What scheduler participants describe of this batch, by name (host data only).
    plugin_inputs: dict[str, Any] = field(default_factory=dict)
    # The builder's host copies (None for batches built elsewhere: graph capture, speculation).
    host: HostBatch | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def set_extend_lens(self, prefix_lens: Sequence[int], extend_lens: Sequence[int],
                        on_device: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Set extend_prefix_lens / extend_seq_lens ([batch_size] int32) and their host copies.
        on_device: the two already on the device (views of a batch's packed copy): no copy made."""
        self.extend_prefix_lens_cpu = torch.tensor(prefix_lens, dtype=torch.int32)
        self.extend_seq_lens_cpu = torch.tensor(extend_lens, dtype=torch.int32)
        if on_device is not None:
            self.extend_prefix_lens, self.extend_seq_lens = on_device
            return
        self.extend_prefix_lens = self.extend_prefix_lens_cpu.to(self.device, non_blocking=True)
        self.extend_seq_lens = self.extend_seq_lens_cpu.to(self.device, non_blocking=True)

    @property
    def tokens_per_request(self) -> int:
        """Decode and verify batches have the same number of new tokens in every request."""
        return self.num_tokens // max(self.batch_size, 1)

    # -- names of the first releases (deprecated) ------------------------------------------------

    @property
    def lora_info(self) -> Any:
        """Deprecated: the LoRA description is `plugin_inputs.get("lora")`; the forward's LoRA
        binding is `ForwardContext.binding("lora")`."""
        _moved_field("lora_info", 'plugin_inputs.get("lora") (inputs) or ForwardContext.binding("lora")')
        return self.plugin_inputs.get("lora")

    @property
    def capture_hidden(self) -> bool:
        """Deprecated: pass `capture_hidden=True` to `ModelRunner.forward`; the model reads
        `ForwardContext.capture_hidden`."""
        _moved_field("capture_hidden", "ModelRunner.forward(batch, capture_hidden=True)")
        return bool(self.__dict__.get("_legacy_capture_hidden", False))

    @capture_hidden.setter
    def capture_hidden(self, value: bool) -> None:
        _moved_field("capture_hidden", "ModelRunner.forward(batch, capture_hidden=True)")
        self.__dict__["_legacy_capture_hidden"] = bool(value)


# The first releases' positional order (plugins built ForwardBatch positionally).
_POSITIONAL = ("forward_mode", "batch_size", "input_ids", "positions", "req_pool_indices", "seq_lens",
               "seq_lens_cpu", "out_cache_loc", "req_to_token_pool", "token_to_kv_pool")
# Fields of 0.1 that are per-forward bindings since 0.2 (accepted with a warning; capture_hidden kept).
_DROPPED = {"capture_hidden": "ModelRunner.forward(batch, capture_hidden=True)",
            "lora_info": 'plugin_inputs["lora"] (inputs) or ForwardContext.binding("lora")',
            "logits_out": "ForwardContext.logits_out", "graph_key": "ForwardContext.graph_key"}
_keyword_init = ForwardBatch.__init__


def _init(self: ForwardBatch, *args: Any, **kwargs: Any) -> None:
    if args:
        if len(args) > len(_POSITIONAL):
            raise TypeError(f"ForwardBatch: expected at most {len(_POSITIONAL)} positional arguments (deprecated; "
                            f"pass every field by keyword), got {len(args)}")
        warnings.warn("ForwardBatch(...) with positional arguments is deprecated since backplane 0.2; pass "
                      f"every field by keyword ({', '.join(_POSITIONAL[:len(args)])}=...)", DeprecationWarning,
                      stacklevel=2)
        kwargs.update(zip(_POSITIONAL, args))
    legacy = {name: kwargs.pop(name) for name in _DROPPED if name in kwargs}
    _keyword_init(self, **kwargs)
    for name, value in legacy.items():
        _moved_field(name, _DROPPED[name])
        if name == "capture_hidden":
            self.__dict__["_legacy_capture_hidden"] = bool(value)


_init.__doc__ = _keyword_init.__doc__
_init.__signature__ = inspect.signature(_keyword_init)  # type: ignore[attr-defined]
ForwardBatch.__init__ = _init  # type: ignore[method-assign]


def _moved_field(name: str, new: str) -> None:
    warnings.warn(f"ForwardBatch.{name} is deprecated since backplane 0.2; use {new}", DeprecationWarning,
                  stacklevel=3)
