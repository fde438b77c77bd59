"""Page-size-1 index arrays for FlashInfer, built on the device without a host synchronisation.

With page size 1 every KV-pool slot is a page, so a request's page list is its row of
`req_to_token`: kv_indices[kv_indptr[i] : kv_indptr[i + 1]] = req_to_token[req_pool_indices[i], :kv_len_i],
and every last page holds exactly one token. The small indptr arrays are built on the host from
the host copies of the lengths (FlashInfer's plan() reads them there anyway); only the long
kv_indices array is built on the device, in one Triton launch on CUDA.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KvSpan:
    """The keys a wrapper reads: the first kv_lens[i] tokens of each request i.

    indptr_cpu: [batch_size + 1] int32 on the host; last_page_len_cpu: [batch_size] int32 ones
    on the host; indices: [indptr_cpu[-1]] int32 KV-pool slots on the device; kv_lens_cpu:
    [batch_size] int32 on the host (with page size 1, each request's number of pages).
    """

    indptr_cpu: torch.Tensor
    indices: torch.Tensor
    last_page_len_cpu: torch.Tensor
    kv_lens_cpu: torch.Tensor

    @property
    def num_indices(self) -> int:
        return int(self.indptr_cpu[-1])


def indptr_from_lens(lens: torch.Tensor) -> torch.Tensor:
    """lens: [n] integer lengths -> [n + 1] int32 exclusive prefix sums (on lens' device)."""
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    indptr[1:] = torch.cumsum(lens, dim=0)
    return indptr


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def build_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    out: torch.Tensor,
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """Gather each request's first kv_len slots from req_to_token into `out`, back to back.

    req_to_token: [num_rows, max_context_len] int32; req_pool_indices: [batch_size];
    kv_indptr: [batch_size + 1] on the same device; out: [kv_indptr[-1]] int32, filled and returned.
    use_kernel: one Triton launch (index_kernel.py; default on CUDA when triton imports), else
    torch ops whose output sizes are known on the host. Neither synchronises.
    """
    if use_kernel is None:
        use_kernel = req_to_token.is_cuda and _has_triton()
    if use_kernel:
        from backplane.plugins.attention_flashinfer.index_kernel import gather_kv_indices

        return gather_kv_indices(req_to_token, req_pool_indices, kv_indptr, out)
    num_indices = out.numel()
    device = req_to_token.device
    batch_size = req_pool_indices.numel()
    kv_indptr = kv_indptr.long()
    kv_lens = kv_indptr[1:] - kv_indptr[:-1]  # [batch_size]
    # request of each output entry, and its position inside that request
    request = torch.repeat_interleave(
        torch.arange(batch_size, device=device), kv_lens, output_size=num_indices
    )  # [num_indices]
    position = torch.arange(num_indices, device=device) - kv_indptr[request]
    rows = req_pool_indices.long()[request]
    out.copy_(req_to_token[rows, position])
    return out


def make_span(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens_cpu: torch.Tensor,
    indptr_buffer: torch.Tensor | None = None,
    indices_buffer: torch.Tensor | None = None,
) -> KvSpan:
    """The KvSpan of the first kv_lens_cpu[i] keys of each request.

    kv_lens_cpu: [batch_size] host lengths. With the optional buffers (CUDA graphs) the device
    indptr and the indices are written into them in place: indptr_buffer [>= batch_size + 1],
    indices_buffer [>= sum(kv_lens_cpu)].
    """
    device = req_to_token.device
    kv_lens_cpu = kv_lens_cpu.to("cpu", torch.int32)
    indptr_cpu = indptr_from_lens(kv_lens_cpu)
    num_indices = int(indptr_cpu[-1])
    batch_size = kv_lens_cpu.numel()
    if indptr_buffer is None:
        kv_indptr = indptr_cpu.to(device, non_blocking=True)
        out = torch.empty(num_indices, dtype=torch.int32, device=device)
    else:
        if num_indices > indices_buffer.numel():
            raise ValueError(
                f"flashinfer graph buffers: expected at most {indices_buffer.numel()} KV indices "
                f"(max batch size x max context length), got {num_indices}"
            )
        kv_indptr = indptr_buffer[: batch_size + 1]
        kv_indptr.copy_(indptr_cpu, non_blocking=True)
        out = indices_buffer[:num_indices]
    build_kv_indices(req_to_token, req_pool_indices, kv_indptr, out)
    last_page_len = torch.ones(batch_size, dtype=torch.int32)
    return KvSpan(indptr_cpu=indptr_cpu, indices=out, last_page_len_cpu=last_page_len, kv_lens_cpu=kv_lens_cpu)
