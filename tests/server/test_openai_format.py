"""The OpenAI response shapes carry no NaN: JSON has none, so a non-finite log-probability is null."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("fastapi")

from backplane.server.openai_format import ChatFormatter, Choice, CompletionFormatter  # noqa: E402


@pytest.mark.parametrize("formatter", [CompletionFormatter, ChatFormatter])
def test_non_finite_logprobs_become_null(formatter):  # docs/reliability.md R69
    fmt = formatter("tiny-llama", lambda t: f"<{t}>", True, False)
    choice = Choice(index=0, num_prompt_tokens=3, token_ids=[5, 6, 7], logprobs=[-0.5, math.nan, -math.inf],
                    text=["<5>", "<6>", "<7>"], finish_reason="length")
    body = json.dumps(fmt.choice(choice), allow_nan=False)  # raises on a bare NaN or Infinity
    logprobs = json.loads(body)["logprobs"]
    got = logprobs["token_logprobs"] if formatter is CompletionFormatter else [c["logprob"] for c in logprobs["content"]]
    assert got == [-0.5, None, None]
