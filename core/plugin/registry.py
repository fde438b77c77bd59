"""What plugins register (spec dataclasses) and the `register` callbacks (selection: selection.py).

A spec is data: a name, a lazy factory, a one-line description and declared capabilities. The
registry validates every item the moment it is registered and remembers which plugin gave it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

from backplane.plugin.validation import ALL_DTYPES, ALL_MODES, PLATFORMS, field_problem  # noqa: F401 - ALL_MODES re-exported


def _always_available() -> str | None:
    return None


# What a backend that does not say otherwise serves. TARGET_VERIFY is left out: it attends under
# the draft tree's custom mask, which a backend must declare (custom_mask=True) before it may claim it.
DEFAULT_MODES = ("extend", "decode", "draft_extend")
# A LoRA backend with supports_graph: the uniform modes (every request the same number of tokens)
LORA_UNIFORM_GRAPH_MODES = ("decode", "target_verify")


@dataclass(frozen=True)
class AttentionBackendSpec:
    """An attention backend: a lazy factory and the capabilities it declares.

    factory(ctx: AttentionBackendContext) -> AttentionBackend, importing heavy modules lazily.
    Every default is the one that cannot give wrong output when a backend forgets to declare it
    (docs/plugins.md, "Spec defaults", lists them):
      platforms: ("cpu", "cuda"); dtypes: all three (an unsupported one fails loudly, not silently).
      head_dims: None, any head dim.
      modes: DEFAULT_MODES (extend, decode, draft_extend); add "target_verify" only with custom_mask.
      graph_modes: () - nothing runs inside a CUDA graph unless declared. A mode here is captured
        in full: the backend's metadata for it lives in static buffers (init_graph_state) that
        init_metadata_for_replay refreshes in place, and "extend" graphs come as token-bucket keys
        (GraphKey.ragged) of requests of any lengths.
      piecewise_graph_modes: () - modes the backend serves eagerly between graph segments: the
        runner captures the layers around each attention call, and calls init_forward_metadata
        and forward as in an eager pass at every replay (on the padded batch). For a backend whose
        planning cannot live in static buffers.
      kv_cache_dtypes: () - KV cache dtypes served besides the model's own ("fp8_e4m3": an FP8
        pool with per-tensor k_scale/v_scale); selection refuses --kv-cache-dtype for a backend
        that does not declare it.
      custom_mask, sliding_window, logit_softcap: False - a backend that ignored the mask, the
        window or the cap would return wrong attention, so selection refuses it for such models.
      seq_len_fill_value: 1, what the graph runner writes into seq_lens of padded requests.
      priority: 0 (`auto` takes the highest; equal priorities go by name, then plugin name).
      available(): None when usable here, else the reason (a missing dependency, say); default: always.
      install_hint: "" - what to run when available() gives a reason (shown with it).
    """

    name: str
    factory: Callable[..., Any]
    description: str
    platforms: tuple[str, ...] = PLATFORMS
    dtypes: tuple[str, ...] = ALL_DTYPES
    head_dims: tuple[int, ...] | None = None
    modes: tuple[str, ...] = DEFAULT_MODES
    graph_modes: tuple[str, ...] = ()
    piecewise_graph_modes: tuple[str, ...] = ()
    kv_cache_dtypes: tuple[str, ...] = ()
    custom_mask: bool = False
    sliding_window: bool = False
    logit_softcap: bool = False
    seq_len_fill_value: int = 1
    priority: int = 0
    available: Callable[[], str | None] = _always_available
    install_hint: str = ""


@dataclass(frozen=True)
class LoraBackendSpec:
    """A LoRA backend. factory(ctx: LoraBackendContext) -> LoraBackend.

    Defaults: platforms and dtypes all; max_rank None (any); supports_graph False (eager only
    unless declared); graph_modes LORA_UNIFORM_GRAPH_MODES (decode, target_verify): the modes a
    backend with supports_graph=True runs inside CUDA graphs (ignored without it); add "extend"
    only for a backend whose graph kernels take segments of any lengths at a fixed token count
    (ragged extend keys); priority 0; available() always; install_hint "".
    """

    name: str
    factory: Callable[..., Any]
    description: str
    platforms: tuple[str, ...] = PLATFORMS
    dtypes: tuple[str, ...] = ALL_DTYPES
    max_rank: int | None = None
    supports_graph: bool = False
    graph_modes: tuple[str, ...] = LORA_UNIFORM_GRAPH_MODES
    priority: int = 0
    available: Callable[[], str | None] = _always_available
    install_hint: str = ""


@dataclass(frozen=True)
class QuantMethodSpec:
    """A quantization method: a lazy factory and the capabilities it declares.

    factory(ctx: backplane.contracts.QuantContext) -> backplane.contracts.QuantConfig, importing its kernels lazily. Defaults (docs/plugins.md,
    "Spec defaults"), each the one that cannot give wrong output when forgotten:
      checkpoint_formats: () - the `quant_method` strings of quantization_config it loads
        ("compressed-tensors", "fp8"); `--quantization auto` picks a method only by this.
      supports_online: False - whether it quantizes a bf16 checkpoint (`--quantization NAME`).
      platforms: ("cpu", "cuda"); dtypes: all three (the run's activation dtype).
      supports_lora, supports_tp, supports_graph, supports_compile: False - selection refuses the
        method for a run that needs what it does not declare.
      priority: 0; available(): None when usable here, else the reason; install_hint: "".
    """

    name: str
    factory: Callable[..., Any]
    description: str
    checkpoint_formats: tuple[str, ...] = ()
    supports_online: bool = False
    platforms: tuple[str, ...] = PLATFORMS
    dtypes: tuple[str, ...] = ALL_DTYPES
    supports_lora: bool = False
    supports_tp: bool = False
    supports_graph: bool = False
    supports_compile: bool = False
    priority: int = 0
    available: Callable[[], str | None] = _always_available
    install_hint: str = ""


@dataclass(frozen=True)
class MoeBackendSpec:
    """A mixture-of-experts backend: a lazy factory and the capabilities it declares.

    factory(ctx: backplane.contracts.MoeBackendContext) -> backplane.contracts.MoeBackend, importing its
    kernels lazily. Defaults (docs/plugins.md, "MoE backends"), each the one that cannot give wrong
    output when forgotten:
      platforms: ("cpu", "cuda"); dtypes: all three (the run's activation dtype).
      max_top_k, max_experts: None - any; else selection refuses a model routing each token to more
        experts, or having more experts per layer, than declared.
      supports_graph, supports_compile: False - selection refuses the backend for a run with CUDA
        graphs or torch.compile unless declared (`apply` must then be capturable / run as the opaque op).
      quant_methods: () - unquantized expert weights only; else the names of the quantization
        methods (--quantization) whose expert weights it computes with.
      priority: 0 (`auto` takes the highest usable); available(): None when usable here, else the
        reason; install_hint: "".
    """

    name: str
    factory: Callable[..., Any]
    description: str
    platforms: tuple[str, ...] = PLATFORMS
    dtypes: tuple[str, ...] = ALL_DTYPES
    max_top_k: int | None = None
    max_experts: int | None = None
    supports_graph: bool = False
    supports_compile: bool = False
    quant_methods: tuple[str, ...] = ()
    priority: int = 0
    available: Callable[[], str | None] = _always_available
    install_hint: str = ""


@dataclass(frozen=True)
class CustomOpImpl:
    """One implementation of a named custom op on one platform; the highest priority usable one wins.

    name: how `--custom-ops op=NAME` refers to it ("native", "flashinfer", ...).
    compile_safe: True when `fn` may be traced by torch.compile as it is: Dynamo sees only traceable
      torch code and ops registered with torch.library (custom_op + register_fake), which stay
      opaque calls in the compiled graph. False (default): inside torch.compile the native
      implementation is used instead.
    """

    op: str
    platform: str
    fn: Callable[..., Any]
    name: str
    priority: int = 0
    available: Callable[[], str | None] = _always_available
    compile_safe: bool = False


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


@dataclass(frozen=True)
class PluginKind:
    """One kind of thing plugins register: its spec type, how messages name it, its hook, its key.

    pinnable: the kind is chosen by a flag (`--attention-backend`, `--lora-backend`), so two plugins
    may register the same name and the user pins one with NAME@PLUGIN; for the other kinds a
    second registration of a key is a RegistrationError.
    """

    name: str
    spec_type: type
    label: str
    hook: str
    key: Callable[[Any], str]
    pinnable: bool = False


KINDS: dict[str, PluginKind] = {kind.name: kind for kind in (
    PluginKind("attention", AttentionBackendSpec, "attention backend", "backplane_register_attention_backends",
               lambda spec: spec.name, pinnable=True),
    PluginKind("lora", LoraBackendSpec, "LoRA backend", "backplane_register_lora_backends",
               lambda spec: spec.name, pinnable=True),
    PluginKind("custom_op", CustomOpImpl, "custom op implementation", "backplane_register_custom_ops",
               lambda impl: f"{impl.op}/{impl.platform}/{impl.name}"),
    PluginKind("spec", SpecAlgorithmSpec, "speculative algorithm", "backplane_register_spec_algorithms",
               lambda spec: spec.name),
    PluginKind("model", ModelSpec, "model architecture", "backplane_register_models",
               lambda spec: spec.architecture),
    PluginKind("quant", QuantMethodSpec, "quantization method", "backplane_register_quant_methods",
               lambda spec: spec.name, pinnable=True),
    PluginKind("moe", MoeBackendSpec, "MoE backend", "backplane_register_moe_backends",
               lambda spec: spec.name, pinnable=True),
    PluginKind("settings", SettingsGroup, "settings group", "backplane_register_settings",
               lambda group: group.group),
)}


class Registry:
    """Everything the loaded plugins registered, keyed by kind and name, with provenance.

    items[kind][key]: the first registration of each key. shared[kind][key]: every registration of
    a pinnable key that more than one plugin registered (selection then needs NAME@PLUGIN).
    not_loaded: plugin name -> why it is not loaded (filtered out, failed), for selection errors.
    """

    def __init__(self) -> None:
        self.items: dict[str, dict[str, Registered]] = {kind: {} for kind in KINDS}
        self.shared: dict[str, dict[str, list[Registered]]] = {kind: {} for kind in KINDS}
        self.not_loaded: dict[str, str] = {}

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
        key = KINDS[kind].key(item)
        new = Registered(item, plugin, distribution)
        existing = self.items[kind].get(key)
        if existing is None:
            self.items[kind][key] = new
        elif KINDS[kind].pinnable and existing.plugin != plugin:
            self.shared[kind].setdefault(key, [existing]).append(new)
        else:
            raise RegistrationError(
                f"{KINDS[kind].label} {key!r} registered twice: by plugin {existing.plugin!r} "
                f"and by plugin {plugin!r}"
            )

    def _validate(self, kind: str, item: Any, plugin: str) -> None:
        """Type, then every field (validation.FIELD_RULES), then the kind's own rules."""
        if kind == "settings":
            _validate_settings_group(item, plugin)
            return
        expected = KINDS[kind].spec_type
        if not isinstance(item, expected):
            raise RegistrationError(
                f"plugin {plugin!r} registered a {type(item).__name__} as {KINDS[kind].label}; "
                f"expected {expected.__name__}"
            )
        problem = field_problem(item)
        if problem is not None:
            raise RegistrationError(f"plugin {plugin!r}, {KINDS[kind].label} {_key_or_field(kind, item)}: {problem[1]}")
        if kind == "custom_op":
            _validate_custom_op(item, plugin)
        elif kind == "attention" and "target_verify" in item.modes and not item.custom_mask:
            raise RegistrationError(f"plugin {plugin!r}, attention backend {item.name!r}: field modes declares "
                                    "'target_verify' without custom_mask=True; a verify pass attends under the "
                                    "draft tree's mask")

    def remove_plugin(self, plugin: str) -> None:
        """Forget everything `plugin` registered (its register hook failed part-way)."""
        for kind, entries in self.items.items():
            for key in [k for k, reg in entries.items() if reg.plugin == plugin]:
                del entries[key]
            for key, regs in list(self.shared[kind].items()):
                kept = [reg for reg in regs if reg.plugin != plugin]
                entries[key] = kept[0]
                if len(kept) > 1:
                    self.shared[kind][key] = kept
                else:
                    del self.shared[kind][key]

    # -- queries --------------------------------------------------------------------------------

    def specs(self, kind: str) -> dict[str, Any]:
        return {key: reg.item for key, reg in self.items[kind].items()}

    def provenance(self, kind: str, key: str) -> Registered:
        return self.items[kind][key]

    def registrations(self, kind: str, key: str | None = None) -> list[Registered]:
        """Every registration of `kind` (of `key` only, when given), shared names included."""
        keys = [key] if key is not None else sorted(self.items[kind])
        return [reg for k in keys if k in self.items[kind]
                for reg in self.shared[kind].get(k, [self.items[kind][k]])]

    def options_group(self, plugin: str) -> str | None:
        """The settings group `plugin` registered (its options reach its factories), or None."""
        groups = [key for key, reg in self.items["settings"].items() if reg.plugin == plugin]
        return groups[0] if groups else None

    def iter_all(self) -> Iterator[tuple[str, str, Registered]]:
        for kind in self.items:
            for reg in self.registrations(kind):
                yield kind, KINDS[kind].key(reg.item), reg


def _key_or_field(kind: str, item: Any) -> str:
    """How an error names the item: its key, or `<invalid key>` when the key field itself is bad."""
    try:
        return repr(KINDS[kind].key(item))
    except Exception:  # noqa: BLE001 - a key built from invalid fields
        return "<invalid key>"


def _validate_custom_op(impl: CustomOpImpl, plugin: str) -> None:
    from backplane.ops.names import OP_NAMES

    if impl.op not in OP_NAMES:
        raise RegistrationError(
            f"plugin {plugin!r} registered custom op {impl.op!r}: field op: expected one of: {', '.join(OP_NAMES)}"
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

