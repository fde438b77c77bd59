"""Acceptance bookkeeping of a speculative worker: for the whole run, and per request."""

from __future__ import annotations

from dataclasses import dataclass, field

from backplane.speculative.accept import Accepted


@dataclass
class SpecStats:
    """Acceptance over every verify step: `mean_acceptance_length` is tokens gained per request per
    step (accepted drafts + the bonus token), between 1 and num_draft_tokens; `histogram` maps
    tokens gained in one request-step to how often. Per request: `SpecWorker.acceptance(req)`."""

    steps: int = 0
    request_steps: int = 0
    tokens: int = 0
    histogram: dict[int, int] = field(default_factory=dict)

    def add(self, accepted: list[Accepted]) -> None:
        self.steps += 1
        for a in accepted:
            self.request_steps += 1
            self.tokens += len(a.new_tokens)
            self.histogram[len(a.new_tokens)] = self.histogram.get(len(a.new_tokens), 0) + 1

    @property
    def mean_acceptance_length(self) -> float:
        return self.tokens / max(self.request_steps, 1)
