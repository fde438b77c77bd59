"""The load generator of bench/serving.py: sharegpt-like token-id requests, Poisson arrival times,
streamed completions over httpx, and the per-rate latency percentiles.

A request is one POST /v1/completions with `stream` and `return_token_ids`, greedy, `ignore_eos`.
TTFT is the time from sending to the first event that carries a token; ITL holds the gaps between
later token events, a gap of an event with k tokens counted as k gaps of gap / k; E2E ends at
`data: [DONE]`. Events that arrive in one network read share its time.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from bench.workload import prompts, shapes


class Workload(NamedTuple):
    """Token-id prompts and the exact output length of each (greedy, ignore_eos)."""

    prompts: list[list[int]]
    output_lens: list[int]


def make_workload(n: int, max_input_len: int, max_output_len: int, vocab: int, seed: int = 0, token_seed: int = 1) -> Workload:
    """bench/e2e.py's sharegpt-like lengths (seeded by `seed`) clamped to the maxima, and random
    token ids in [3, vocab) seeded by `token_seed`: the same lengths with other tokens share no prefix."""
    lengths = [(min(i, max_input_len), min(o, max_output_len)) for i, o in shapes("sharegpt-like", n, seed=seed)]
    return Workload(prompts([i for i, _ in lengths], vocab, seed=token_seed), [o for _, o in lengths])


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of a Poisson process of `rate` requests/s; all 0 at inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return list(itertools.accumulate((rng.expovariate(rate) for _ in range(n)), initial=0.0))[:n]


@dataclass
class RequestResult:
    """One request as the client saw it; times are time.perf_counter() seconds."""

    input_len: int
    asked_len: int
    token_ids: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None
    sent_at: float = 0.0
    done_at: float = 0.0

    def on_tokens(self, token_ids: list[int], now: float, last: float) -> None:
        """An event with `token_ids` read at `now`; `last`: when the previous token event was read."""
        if self.ttft_s is None:
            self.ttft_s = now - self.sent_at
        else:
            self.itl_s += [(now - last) / len(token_ids)] * len(token_ids)
        self.token_ids += token_ids


async def send(client, url: str, prompt: list[int], max_tokens: int) -> RequestResult:
    """One streamed completion; the result holds its timings, tokens and any error."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    result = RequestResult(len(prompt), max_tokens, sent_at=time.perf_counter())
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
            else:
                await read_events(response, result)
    except Exception as err:  # noqa: BLE001 - a failed request is counted, the run goes on
        result.error = f"{type(err).__name__}: {err}"
    result.done_at = time.perf_counter()
    result.latency_s = result.done_at - result.sent_at
    return result


async def read_events(response, result: RequestResult) -> None:
    """Server-sent events `data: {...}` until `data: [DONE]`; every event in one read shares its time."""
    buffer, last = b"", result.sent_at
    async for data in response.aiter_bytes():
        now = time.perf_counter()
        *events, buffer = (buffer + data).split(b"\n\n")
        for event in events:
            payload = event.removeprefix(b"data: ")
            if payload == b"[DONE]":
                return
            obj = json.loads(payload)
            if "error" in obj:
                result.error = str(obj["error"].get("message", obj["error"]))
                return
            choices = obj.get("choices") or [{}]  # the usage chunk has no choices
            token_ids = choices[0].get("token_ids") or []
            if token_ids:
                result.on_tokens(token_ids, now, last)
                last = now
    result.error = result.error or "the stream ended without data: [DONE]"


async def run_rate(client, url: str, work: Workload, rate: float, seed: int) -> list[RequestResult]:
    """Send the requests at their Poisson times; wait for all of them."""
    start = time.perf_counter()
    tasks = []
    for prompt, n_out, offset in zip(work.prompts, work.output_lens, arrival_offsets(len(work.prompts), rate, seed)):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(client, url, prompt, n_out)))
    return list(await asyncio.gather(*tasks))


def percentile(values: list[float], q: int) -> float | None:
    """The q-th percentile, interpolated between the closest ranks (numpy's default); None for no values."""
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def ms(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": None if (v := percentile(values, q)) is None else v * 1e3 for q in (50, 99)}


def rate_name(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def summarize(results: list[RequestResult], rate: float) -> dict:
    """One rate's row: counts, output tokens/s (first send to last finish), latency percentiles in ms."""
    ok = [r for r in results if r.error is None]
    duration = max(r.done_at for r in results) - min(r.sent_at for r in results)
    num_out = sum(len(r.token_ids) for r in ok)
    tpot = [(r.latency_s - r.ttft_s) / (len(r.token_ids) - 1) for r in ok if len(r.token_ids) > 1]
    return {
        "rate": rate_name(rate), "requests": len(results), "completed": len(ok),
        "errors": [r.error for r in results if r.error][:5],
        "short_outputs": sum(len(r.token_ids) != r.asked_len for r in ok),
        "duration_s": duration, "input_tokens": sum(r.input_len for r in ok), "output_tokens": num_out,
        "output_tok_s": num_out / duration, "request_s": len(ok) / duration,
        "ttft_ms": ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": ms([gap for r in ok for gap in r.itl_s]), "e2e_ms": ms([r.latency_s for r in ok]),
        "tpot_ms": ms(tpot), "median_input_len": statistics.median(r.input_len for r in results),
        "outputs": [r.token_ids for r in results],
    }
