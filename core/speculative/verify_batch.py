"""The TARGET_VERIFY batch: every request's draft-tree tokens after its cached ones, in one copy.

Here rather than in the engine's batch builder so that speculative decoding does not import the
engine (the engine imports speculative decoding). A request is anything with `num_cached` and `row`.
"""

from __future__ import annotations

import torch

from backplane.contracts.batch import ForwardBatch, ForwardMode
from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool


def build_verify_batch(reqs: list, input_ids: list[int] | torch.Tensor, positions: list[int],
                       out_cache_loc: torch.Tensor, num_nodes: int, custom_mask: torch.Tensor, mask_indptr: torch.Tensor,
                       req_pool: ReqToTokenPool, kv_pool: TokenToKVPool) -> ForwardBatch:
    """TARGET_VERIFY: `num_nodes` draft-tree tokens per request after its `num_cached` cached ones.

    input_ids: host ints, or a device tensor (a draft's output, not waited for). The slots
    (out_cache_loc, host) are already in req_to_token; positions are num_cached + depth;
    custom_mask / mask_indptr as in ForwardBatch (host tensors). Every integer goes to the device in
    one copy (a speculative step runs one verify per few tokens; its host time counts).
    """
    device = req_pool.req_to_token.device
    bs, n = len(reqs), len(positions)
    prefix = [req.num_cached for req in reqs]
    seq = [p + num_nodes for p in prefix]
    ids_on_device = isinstance(input_ids, torch.Tensor)  # a draft's output, left on the device
    ints = torch.tensor(([0] * n if ids_on_device else input_ids) + list(positions) + out_cache_loc.tolist()
                        + [req.row for req in reqs] + seq + prefix + [num_nodes] * bs + mask_indptr.tolist(),
                        dtype=torch.int64)
    dev = ints.to(device, non_blocking=True)
    lens = dev[3 * n + bs: 3 * n + 4 * bs].to(torch.int32)  # seq_lens, prefix lens, extend lens
    batch = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=input_ids if ids_on_device else dev[:n],
        positions=dev[n:2 * n],
        req_pool_indices=dev[3 * n: 3 * n + bs], seq_lens=lens[:bs], seq_lens_cpu=torch.tensor(seq, dtype=torch.int32),
        out_cache_loc=dev[2 * n:3 * n], req_to_token_pool=req_pool, token_to_kv_pool=kv_pool,
        extend_prefix_lens=lens[bs:2 * bs], extend_seq_lens=lens[2 * bs:],
        extend_prefix_lens_cpu=torch.tensor(prefix, dtype=torch.int32),
        extend_seq_lens_cpu=torch.full((bs,), num_nodes, dtype=torch.int32),
    )
    batch.custom_mask = custom_mask.to(device, non_blocking=True)
    batch.mask_indptr = dev[3 * n + 4 * bs:]
    return batch
