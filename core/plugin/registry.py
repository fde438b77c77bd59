"""What plugins register (spec dataclasses), the `register` callbacks, and backend selection.

A spec is data: a name, a lazy factory, a one-line description and declared capabilities. The
registry validates every item the moment it is registered and remembers which plugin gave it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

ALL_MODES = ("extend", "decode", "target_verify", "draft_extend")
ALL_DTYPES = ("float32", "float16", "bfloat16")
PLATFORMS = ("cpu", "cuda")


def _always_available() -> str | None:
    return None


@dataclass(frozen=True)
class AttentionBackendSpec:
    """An attention backend.

    factory(ctx: AttentionBackendContext) -> AttentionBackend, importing heavy modules lazily.
    head_dims: the supported head dims, or None for any.
    modes / graph_modes: forward modes served, and those that may run inside a CUDA graph.
    seq_len_fill_value: what the graph runner writes into seq_lens of padded requests.
    available(): None when usable here, else the reason (a missing dependency, say).
    """

    name: str
    factory: Callable[..., Any]
    description: str
    platforms: tuple[str, ...] = PLATFORMS
    dtypes: tuple[str, ...] = ALL_DTYPES
    head_dims: tuple[int, ...] | None = None
    modes: tuple[str, ...] = ALL_MODES
    graph_modes: tuple[str, ...] = ()
    custom_mask: bool = True
    sliding_window: bool = True
    logit_softcap: bool = True
    seq_len_fill_value: int = 1
    priority: int = 0
    available: Callable[[], str | None] = _always_available
    install_hint: str = ""


@dataclass(frozen=True)
class LoraBackendSpec:
    """A LoRA backend. factory(ctx: LoraBackendContext) -> LoraBackend."""

    name: str
    factory: Callable[..., Any]
    description: str
    platforms: tuple[str, ...] = PLATFORMS
    dtypes: tuple[str, ...] = ALL_DTYPES
    max_rank: int | None = None
    supports_graph: bool = False
    priority: int = 0
    available: Callable[[], str | None] = _always_available
    install_hint: str = ""


@dataclass(frozen=True)
class CustomOpImpl:
    """One implementation of a named custom op on one platform; the highest priority usable one wins.

    name: how `--custom-ops op=NAME` refers to it ("native", "flashinfer", ...).
    """

    op: str
    platform: str
    fn: Callable[..., Any]
    name: str
    priority: int = 0
    available: Callable[[], str | None] = _always_available


@dataclass(frozen=True)
class SpecAlgorithmSpec:
    """A speculative-decoding algorithm. factory(ctx) -> SpecWorker."""

    name: str
    factory: Callable[..., Any]
    description: str
    needs_draft_model: bool = False
    supports_lora: bool = False
    supports_sampling: bool = False


@dataclass(frozen=True)
class ModelSpec:
    """A model class for a Hugging Face `architectures` name. factory(hf_config, ctx) -> nn.Module."""

    architecture: str
    factory: Callable[..., Any]
    description: str = ""


@dataclass(frozen=True)
class SettingsGroup:
    """A plugin's option group: `--<group>.<option>` on the CLI, BACKPLANE_<GROUP>__<OPTION> in the env."""

    group: str
    model: type
    plugin: str = ""


@dataclass(frozen=True)
class Registered:
    """An item together with the plugin (and distribution) that registered it."""

    item: Any
    plugin: str
    distribution: str | None = None


class RegistrationError(ValueError):
    """A plugin registered something invalid (wrong type, duplicate name, unknown op)."""


_KIND_TYPES = {
    "attention": AttentionBackendSpec,
    "lora": LoraBackendSpec,
    "spec": SpecAlgorithmSpec,
    "model": ModelSpec,
}


def _spec_key(kind: str, item: Any) -> str:
    if kind == "model":
        return item.architecture
    if kind == "custom_op":
        return f"{item.op}/{item.platform}/{item.name}"
    if kind == "settings":
        return item.group
    return item.name


class Registry:
    """Everything the loaded plugins registered, keyed by kind and name, with provenance."""

    def __init__(self) -> None:
        self.items: dict[str, dict[str, Registered]] = {
            kind: {} for kind in ("attention", "lora", "custom_op", "spec", "model", "settings")
        }

    # -- register callbacks -------------------------------------------------------------------

    def callback(self, kind: str, plugin: str, distribution: str | None) -> Callable[..., None]:
        """The `register` function handed to one plugin's register hook for `kind`."""
        if kind == "settings":
            return lambda group, model: self._add(
                "settings", SettingsGroup(group, model, plugin), plugin, distribution
            )
        return lambda item: self._add(kind, item, plugin, distribution)

    def _add(self, kind: str, item: Any, plugin: str, distribution: str | None) -> None:
        self._validate(kind, item, plugin)
        key = _spec_key(kind, item)
        existing = self.items[kind].get(key)
        if existing is not None:
            raise RegistrationError(
                f"{_KIND_LABEL[kind]} {key!r} registered twice: by plugin {existing.plugin!r} "
                f"and by plugin {plugin!r}"
            )
        self.items[kind][key] = Registered(item, plugin, distribution)

    def _validate(self, kind: str, item: Any, plugin: str) -> None:
        if kind == "custom_op":
            _validate_custom_op(item, plugin)
        elif kind == "settings":
            _validate_settings_group(item, plugin)
        else:
            expected = _KIND_TYPES[kind]
            if not isinstance(item, expected):
                raise RegistrationError(
                    f"plugin {plugin!r} registered a {type(item).__name__} as {_KIND_LABEL[kind]}; "
                    f"expected {expected.__name__}"
                )
            if kind in ("attention", "lora"):
                _validate_backend_spec(item, plugin)

    def remove_plugin(self, plugin: str) -> None:
        """Forget everything `plugin` registered (its register hook failed part-way)."""
        for entries in self.items.values():
            for key in [k for k, reg in entries.items() if reg.plugin == plugin]:
                del entries[key]

    # -- queries --------------------------------------------------------------------------------

    def specs(self, kind: str) -> dict[str, Any]:
        return {key: reg.item for key, reg in self.items[kind].items()}

    def provenance(self, kind: str, key: str) -> Registered:
        return self.items[kind][key]

    def iter_all(self) -> Iterator[tuple[str, str, Registered]]:
        for kind, entries in self.items.items():
            for key, reg in entries.items():
                yield kind, key, reg


_KIND_LABEL = {
    "attention": "attention backend",
    "lora": "LoRA backend",
    "custom_op": "custom op implementation",
    "spec": "speculative algorithm",
    "model": "model architecture",
    "settings": "settings group",
}


def _validate_backend_spec(spec: Any, plugin: str) -> None:
    where = f"plugin {plugin!r}, backend {spec.name!r}"
    if not spec.name or not isinstance(spec.name, str):
        raise RegistrationError(f"{where}: name must be a non-empty string")
    if not callable(spec.factory):
        raise RegistrationError(f"{where}: factory must be callable, got {type(spec.factory).__name__}")
    bad = [p for p in spec.platforms if p not in PLATFORMS]
    if bad:
        raise RegistrationError(f"{where}: unknown platform {bad[0]!r}; expected one of {PLATFORMS}")
    bad = [d for d in spec.dtypes if d not in ALL_DTYPES]
    if bad:
        raise RegistrationError(f"{where}: unknown dtype {bad[0]!r}; expected one of {ALL_DTYPES}")
    if isinstance(spec, AttentionBackendSpec):
        bad = [m for m in (*spec.modes, *spec.graph_modes) if m not in ALL_MODES]
        if bad:
            raise RegistrationError(f"{where}: unknown mode {bad[0]!r}; expected one of {ALL_MODES}")


def _validate_custom_op(impl: Any, plugin: str) -> None:
    from backplane.ops.names import OP_NAMES

    if not isinstance(impl, CustomOpImpl):
        raise RegistrationError(
            f"plugin {plugin!r} registered a {type(impl).__name__} as custom op; expected CustomOpImpl"
        )
    if impl.op not in OP_NAMES:
        raise RegistrationError(
            f"plugin {plugin!r} registered custom op {impl.op!r}; expected one of: {', '.join(OP_NAMES)}"
        )
    if impl.platform not in PLATFORMS:
        raise RegistrationError(
            f"plugin {plugin!r}, custom op {impl.op!r}: unknown platform {impl.platform!r}; "
            f"expected one of {PLATFORMS}"
        )


def _validate_settings_group(group: SettingsGroup, plugin: str) -> None:
    from pydantic import BaseModel

    if not isinstance(group.group, str) or not group.group.replace("-", "").isalnum():
        raise RegistrationError(
            f"plugin {plugin!r}: settings group name {group.group!r} must be letters, digits and '-'"
        )
    if not (isinstance(group.model, type) and issubclass(group.model, BaseModel)):
        raise RegistrationError(
            f"plugin {plugin!r}: settings group {group.group!r} must be a pydantic BaseModel class"
        )
    missing = [n for n, f in group.model.model_fields.items() if f.is_required()]
    if missing:
        raise RegistrationError(
            f"plugin {plugin!r}: settings group {group.group!r} field {missing[0]!r} needs a default"
        )

