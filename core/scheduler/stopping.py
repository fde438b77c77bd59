"""When a request stops: end-of-sequence, a stop token, a stop string, or max_new_tokens."""

from __future__ import annotations

from typing import Callable

from backplane.scheduler.request import FinishReason, Req


def check_stop(req: Req, eos_token_ids: set[int], detokenize: Callable[[list[int]], str]) -> bool:
    """Set req.finish_reason (and cut req.text at a stop string) when the request is done."""
    token = req.output_ids[-1]
    params = req.params
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
        req.finish_reason = FinishReason.STOP
    elif params.stop and _cut_at_stop_string(req, detokenize):
        req.finish_reason = FinishReason.STOP
    elif len(req.output_ids) >= params.max_new_tokens:
        req.finish_reason = FinishReason.LENGTH
    return req.finished


def _cut_at_stop_string(req: Req, detokenize: Callable[[list[int]], str]) -> bool:
    text = detokenize(req.output_ids)
    hits = [i for i in (text.find(s) for s in req.params.stop) if i >= 0]
    if not hits:
        return False
    req.text = text[: min(hits)]
    return True
