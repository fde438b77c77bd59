"""Which batch sizes the graph runner captures and which modes it may capture (GraphKey itself is
a contract: backplane.contracts.graph).

Pure functions of the settings and of what the active plugins declare, so they are tested on CPU.
"""

from __future__ import annotations

import bisect
from typing import Any

from backplane.contracts.batch import ForwardMode
from backplane.contracts.graph import GraphKey, GraphParticipant, ModeLimit  # noqa: F401  (GraphKey re-exported)

DEFAULT_SIZES = [1, 2, 4] + [8 * k for k in range(1, 21)]  # 1, 2, 4, 8, 16, ..., 160 (the default max)
NO_PADDING_SIZES = list(range(1, 33)) + [64, 128]
# Extend graphs: token buckets double to 64, then grow by half (at most a third of a bucket is padding).
EXTEND_TOKEN_LADDER = [8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
EXTEND_BATCH_LADDER = [1, 2, 4, 8, 16, 32]


def capture_batch_sizes(args: Any, req_pool_size: int) -> tuple[list[int], list[int]]:
    """(sizes to capture, the subset to torch.compile), both ascending.

    --cuda-graph-bs wins; else the default ladder, 1, 2, 4 and multiples of 8 up to
    --cuda-graph-max-bs (or 1..32, 64, 128 without padding). A request pool smaller than the
    largest size adds the pool size and pool size - 1. Everything is cut at --cuda-graph-max-bs and
    the pool size.
    """
    if args.cuda_graph_bs:
        sizes = list(args.cuda_graph_bs)
    else:
        # The ladder runs to 160 (SGLang's) or further when --cuda-graph-max-bs asks for more;
        # a smaller max only cuts it, so the pool-size sizes below still join under that max.
        ladder = [1, 2, 4] + list(range(8, max(DEFAULT_SIZES[-1], args.cuda_graph_max_bs) + 1, 8))
        sizes = list(NO_PADDING_SIZES) if args.disable_cuda_graph_padding else ladder
        if max(sizes) > req_pool_size:
            sizes += [req_pool_size - 1, req_pool_size]
    limit = min(args.cuda_graph_max_bs, req_pool_size)
    sizes = sorted({bs for bs in sizes if 1 <= bs <= limit})
    compiled = [bs for bs in sizes if bs <= args.torch_compile_max_bs] if args.enable_torch_compile else []
    return sizes, compiled


def padded_size(batch_size: int, sizes: list[int], allow_padding: bool = True) -> int | None:
    """The smallest captured size >= batch_size, or None when the batch is too large. Without
    padding (--disable-cuda-graph-padding) only an exactly captured size, else None (eager)."""
    if not allow_padding:
        return batch_size if batch_size in sizes else None
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


def tokens_per_request(args: Any, mode: ForwardMode) -> int:
    """New tokens per request of a `mode` graph: the draft-token count for verify, else 1."""
    return int(args.speculative_num_draft_tokens) if mode is ForwardMode.TARGET_VERIFY else 1


def extend_token_buckets(max_tokens: int) -> list[int]:
    """Token buckets of the extend graphs, ascending: the ladder cut at `max_tokens`, which joins
    it when it is not a rung (so a chunk of exactly --cuda-graph-max-tokens replays)."""
    buckets = [t for t in EXTEND_TOKEN_LADDER if t <= max_tokens]
    if max_tokens not in buckets:
        buckets.append(max_tokens)
    return buckets


def extend_batch_sizes(max_bs: int) -> list[int]:
    """Request slots of the extend graphs, ascending: 1, 2, 4, ... up to `max_bs` (which joins)."""
    sizes = [b for b in EXTEND_BATCH_LADDER if b <= max_bs]
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sizes


def extend_shape(num_tokens: int, batch_size: int, buckets: list[int], sizes: list[int]) -> tuple[int, int] | None:
    """(request slots, token bucket) of the extend graph that replays a batch of `batch_size`
    requests and `num_tokens` new tokens, or None (eager): the smallest bucket that holds the tokens,
    and the smallest slot count that holds the requests plus, when the bucket has room left, the
    padded request that takes it."""
    if num_tokens < 1 or batch_size < 1:
        return None
    i = bisect.bisect_left(buckets, num_tokens)
    if i == len(buckets):
        return None
    bucket = buckets[i]
    need = batch_size + (1 if bucket > num_tokens else 0)
    j = bisect.bisect_left(sizes, need)
    if j == len(sizes) or sizes[j] > bucket:
        return None
    return sizes[j], bucket


def combine_variants(variant_lists: list[list[tuple]]) -> list[tuple]:
    """Every combination of the contributors' graph-key extras, one variant of each contributor
    per combination (their items concatenated in contributor order); [()] without contributors."""
    combos: list[tuple] = [()]
    for variants in variant_lists:
        combos = [c + v for c in combos for v in variants]
    return combos


def capture_kinds(wanted: list[str], participants: list[GraphParticipant]) -> tuple[dict[str, str], list[ModeLimit]]:
    """How each wanted mode is captured: "full" when every participant serving it declares it in
    graph_modes; "piecewise" when some declare it only as piecewise (the rest full); dropped, with a
    ModeLimit naming the first participant that declares neither. The minimum over participants."""
    kinds: dict[str, str] = {}
    limits: list[ModeLimit] = []
    for mode in wanted:
        serving = [p for p in participants if p.serves is None or mode in p.serves]
        blockers = [p for p in serving if mode not in p.graph_modes and mode not in p.piecewise_modes]
        if blockers:
            b = blockers[0]
            declared = ", ".join(b.graph_modes) or "none"
            detail = f"declares graph modes: {declared}"
            if b.piecewise_modes:
                detail += f" (piecewise: {', '.join(b.piecewise_modes)})"
            limits.append(ModeLimit(mode, b.plugin, b.item, detail))
        else:
            kinds[mode] = "full" if all(mode in p.graph_modes for p in serving) else "piecewise"
    return kinds, limits


def capturable_modes(wanted: list[str], participants: list[GraphParticipant]) -> tuple[list[str], list[ModeLimit]]:
    """The modes every participant can capture (fully or piecewise), and a ModeLimit for each one dropped."""
    kinds, limits = capture_kinds(wanted, participants)
    return list(kinds), limits
