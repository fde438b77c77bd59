"""When a request stops: end-of-sequence, a stop token, a stop string, or max_new_tokens.

Stop strings are matched on the tail of the output text only: after a token, the text is decoded
over a short window of the last tokens, and each position the new characters end at is looked up
once per distinct stop-string length (a set lookup). The cost per step depends on the longest stop
string and the number of distinct lengths, not on the number of strings or the length of the output;
the whole text is decoded once, when a stop string is found, to cut it there.
"""

from __future__ import annotations

from typing import Callable

from backplane.scheduler.request import FinishReason, Req

MARGIN = 4  # characters at a window's start that may decode differently from the whole text


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


def append_tokens(req: Req, tokens: list[int], logprobs: list[float], eos_token_ids: set[int],
                  detokenize: Callable[[list[int]], str]) -> bool:
    """Append a step's new tokens (one, or several accepted drafts) and their log-probabilities to
    `req` until it stops; whether it stopped (the tokens after the stopping one are dropped)."""
    for token, logprob in zip(tokens, logprobs):
        if append_token(req, token, logprob, eos_token_ids, detokenize):
            return True
    return False


def append_token(req: Req, token: int, logprob: float, eos_token_ids: set[int],
                 detokenize: Callable[[list[int]], str]) -> bool:
    """`append_tokens` of one token: append it and its log-probability; whether `req` stopped.

    NOTE: run for every request at every decode step: `check_stop` runs only when one of its
    conditions may hold (an end-of-sequence token, stop tokens or strings, max_new_tokens reached,
    or the request already finished), so the usual token costs one test here.
    """
    output_ids, params = req.output_ids, req.params
    output_ids.append(token)
    req.logprobs.append(logprob)
    if (token in eos_token_ids or params.stop_token_ids or params.stop
            or len(output_ids) >= params.max_new_tokens or req.finish_reason is not None):
        return check_stop(req, eos_token_ids, detokenize)
    return False

class StopStrings:
    """One request's stop strings, grouped by length for the tail lookup."""

    def __init__(self, stops: list[str]):
        self.by_length: dict[int, frozenset[str]] = {}
        for length in {len(s) for s in stops}:
            self.by_length[length] = frozenset(s for s in stops if len(s) == length)
        self.max_len = max(self.by_length)

    def found_in_tail(self, ids: list[int], detokenize: Callable[[list[int]], str]) -> list[str]:
        """The stop strings that end in the text the last token of `ids` added."""
        num = self.max_len + MARGIN + 2
        while True:
            start = max(len(ids) - num, 0)
            tail = detokenize(ids[start:])
            if start == 0 or len(tail) >= self.max_len + 2 * MARGIN:
                break
            num *= 2  # tokens without text (special ones) in the window: widen it
        new = len(tail) - len(detokenize(ids[start:-1])) + MARGIN  # NOTE: + a token may rewrite a few before it
        first = 0 if start == 0 else MARGIN
        hits = []
        for end in range(max(len(tail) - new, first), len(tail) + 1):
            for length, strings in self.by_length.items():
                if end - length >= first and tail[end - length:end] in strings:
                    hits.append(tail[end - length:end])
        return hits


def _cut_at_stop_string(req: Req, detokenize: Callable[[list[int]], str]) -> bool:
    if req.stop_strings is None:
        req.stop_strings = StopStrings(req.params.stop)
    hits = req.stop_strings.found_in_tail(req.output_ids, detokenize)
    if not hits:
        return False
    text = detokenize(req.output_ids)
    found = [i for i in (text.find(s) for s in hits) if i >= 0]
    req.text = text[: min(found)] if found else text
    return True
