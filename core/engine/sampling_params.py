"""SamplingParams: how one request's tokens are chosen and when it stops."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request sampling settings, validated on construction.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 disable those filters; min_p 0 too.
    seed: the same seed gives the same tokens for the same prompt, whatever else is in the batch.
    stop: strings that end the request (the text is cut before them); stop_token_ids: token ids
    that end it (kept in token_ids). ignore_eos keeps generating past the end-of-sequence token.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            ("max_new_tokens", self.max_new_tokens, isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, "an integer >= 1"),
            ("temperature", self.temperature, self.temperature >= 0, ">= 0 (0 is greedy)"),
            ("top_k", self.top_k, isinstance(self.top_k, int) and self.top_k >= -1, "an integer >= 1, or 0/-1 for no limit"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", self.min_p, 0 <= self.min_p <= 1, "in [0, 1]"),
            ("seed", self.seed, self.seed is None or (isinstance(self.seed, int) and self.seed >= 0), "None or an integer >= 0"),
            ("stop", self.stop, all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
            ("stop_token_ids", self.stop_token_ids, all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "token ids >= 0"),
        ]
        for name, value, ok, expected in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}: expected {expected}, got {value!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
