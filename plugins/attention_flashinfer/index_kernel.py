"""One Triton launch that gathers each request's KV slots from req_to_token (page size 1).

The torch expression of the same gather (`indices.build_kv_indices`'s fallback) is about ten small
device ops a step, each a launch the host pays for; FlashInfer's per-step planning is host work
that decode waits on, so the index array is built in one launch instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 512  # slots copied per loop step of a program


@triton.jit
def _gather_kv_indices_kernel(Req_to_token, Rows, Indptr, Out, stride_req, BLOCK: tl.constexpr):
    # one program per request b: Out[indptr[b] : indptr[b + 1]] = req_to_token[rows[b], : len_b]
    b = tl.program_id(0)
    row = tl.load(Rows + b).to(tl.int64)
    start = tl.load(Indptr + b).to(tl.int64)
    count = tl.load(Indptr + b + 1).to(tl.int64) - start
    src = Req_to_token + row * stride_req
    for i in range(0, count, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        mask = offs < count
        tl.store(Out + start + offs, tl.load(src + offs, mask=mask), mask=mask)


def gather_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_indptr: torch.Tensor,
                      out: torch.Tensor) -> torch.Tensor:
    """out [kv_indptr[-1]] int32 = each request's first kv_len slots of its req_to_token row, back to
    back. req_to_token: [rows, max_context_len] int32 (row-contiguous); req_pool_indices: [bs];
    kv_indptr: [bs + 1] int32 on the same device."""
    assert req_to_token.stride(1) == 1, "req_to_token rows must be contiguous"
    batch_size = req_pool_indices.numel()
    if batch_size and out.numel():
        _gather_kv_indices_kernel[(batch_size,)](req_to_token, req_pool_indices, kv_indptr, out,
                                                 req_to_token.stride(0), BLOCK=BLOCK)
    return out
