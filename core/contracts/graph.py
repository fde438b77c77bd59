"""GraphKey and GraphParticipant: how a CUDA graph is named, and an active plugin's say in which
modes are captured and how (full or piecewise). Backends receive a GraphKey at capture and replay;
contributors return a GraphParticipant. Pure data, so every layer above can import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

from backplane.contracts.batch import ForwardMode


@dataclass(frozen=True)
class GraphKey:
    """Everything that changes the recorded kernels of one graph.

    Uniform graphs (decode, verify, a draft window) hold `tokens_per_request` new tokens in each of
    `batch_size` requests. Ragged graphs (EXTEND: prefill, chunked prefill, an extend over a cached
    prefix) hold `token_bucket` new tokens shared by at most `batch_size` requests of any lengths;
    their tokens_per_request is 0. A real extend batch is padded to the bucket: one padded request
    (the pool's padding row, no prefix) takes the padded tokens, whose K/V go to the dump slot 0;
    any further padded request has no tokens, and padded requests' logits rows are dropped.
    extras: contributions of active plugins, e.g. (("lora", True),), sorted by name.
    capture: "full" (the whole forward is one graph) or "piecewise" (graph segments between the
    attention calls, which run eagerly); what the attention backend declared for the mode.
    """

    mode: ForwardMode
    batch_size: int
    tokens_per_request: int
    extras: tuple[tuple[str, Hashable], ...] = ()
    token_bucket: int = 0
    capture: str = "full"

    @property
    def ragged(self) -> bool:
        """A token-bucket graph (requests of any lengths) rather than a uniform one."""
        return self.token_bucket > 0

    @property
    def num_tokens(self) -> int:
        return self.token_bucket if self.ragged else self.batch_size * self.tokens_per_request


@dataclass(frozen=True)
class ModeLimit:
    """Why a mode is not captured: which plugin (and which of its items) limits it."""

    mode: str
    plugin: str
    item: str
    detail: str

    def message(self) -> str:
        return (f"CUDA graphs: {self.mode} runs eagerly because plugin {self.plugin!r} ({self.item}) "
                f"{self.detail}")


@dataclass(frozen=True)
class GraphParticipant:
    """An active plugin's say in graph capture: of the modes it takes part in (`serves`; None:
    every mode), those it can run inside one graph (`graph_modes`, full capture) and those it can
    run eagerly between graph segments (`piecewise_modes`, attention backends only: the runner
    captures the layers around their calls)."""

    plugin: str
    item: str
    graph_modes: tuple[str, ...]
    serves: tuple[str, ...] | None = None
    piecewise_modes: tuple[str, ...] = ()
