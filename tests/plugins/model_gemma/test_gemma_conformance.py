"""Gemma 2 and Gemma 3 (text) pass backplane.testing.model_conformance against transformers on the CPU in fp32.

The overrides switch every Gemma feature on where the small random configs reach it: a sliding window
of 8 tokens (shorter than the prompts, so the sliding layers see less than the global ones), attention
and final logit soft-caps low enough to bend the logits, and a query_pre_attn_scalar other than the
head dim.
"""

from __future__ import annotations

import transformers

from backplane.testing import model_conformance

GEMMA_FEATURES = dict(sliding_window=8, attn_logit_softcapping=4.0, final_logit_softcapping=3.0,
                      query_pre_attn_scalar=24)

test_gemma2 = model_conformance.make_suite("Gemma2ForCausalLM", transformers.Gemma2Config, **GEMMA_FEATURES)
