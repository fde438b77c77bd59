"""GraphKey and GraphParticipant: how a CUDA graph is named, and an active plugin's say in which
modes are captured. Backends receive a GraphKey at capture and replay; contributors return a
GraphParticipant. Pure data, so every layer above can import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

from backplane.contracts.batch import ForwardMode


@dataclass(frozen=True)
class GraphKey:
    """Everything that changes the recorded kernels of one graph.

    extras: contributions of active plugins, e.g. (("lora", True),), sorted by name.
    """

    mode: ForwardMode
    batch_size: int
    tokens_per_request: int
    extras: tuple[tuple[str, Hashable], ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.batch_size * self.tokens_per_request


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
    every mode), those it can run inside a graph."""

    plugin: str
    item: str
    graph_modes: tuple[str, ...]
    serves: tuple[str, ...] | None = None
