"""Every hook a backplane plugin can implement.

Each docstring says, in this order: when the hook is called, what the implementation must do,
its parameters, and how results are combined. Hooks are called with keyword arguments only, and
an implementation may accept any subset of the arguments. They are resolved once at startup into
plain objects; nothing here is called inside a forward pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:
    from backplane.plugin.registry import (
        AttentionBackendSpec,
        CustomOpImpl,
        LoraBackendSpec,
        ModelSpec,
        MoeBackendSpec,
        QuantMethodSpec,
        SpecAlgorithmSpec,
    )

PROJECT_NAME = "backplane"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def backplane_register_attention_backends(register: Callable[[AttentionBackendSpec], None]) -> None:
    """Register attention backends.

    When: once, during plugin discovery, before settings are parsed.
    Must: call ``register(AttentionBackendSpec(...))`` once per backend; import nothing heavy
    (the spec's factory imports its kernels when the backend is built).
    Params: register -- validates the spec at once; a duplicate name is an error naming both plugins.
    Semantics: called on every plugin; return values are ignored.
    """


@hookspec
def backplane_register_lora_backends(register: Callable[[LoraBackendSpec], None]) -> None:
    """Register LoRA backends.

    When: once, during plugin discovery.
    Must: call ``register(LoraBackendSpec(...))`` once per backend, importing nothing heavy.
    Params: register -- validates at once; duplicate names are errors naming both plugins.
    Semantics: called on every plugin; return values are ignored.
    """


@hookspec
def backplane_register_custom_ops(register: Callable[[CustomOpImpl], None]) -> None:
    """Register implementations of named custom ops (rms_norm, silu_and_mul, rotary_embedding, ...).

    When: once, during plugin discovery.
    Must: call ``register(CustomOpImpl(op=..., platform=..., fn=..., name=..., priority=...))``;
    ``fn`` must have the signature of the op's native implementation in ``backplane.ops``.
    Params: register -- rejects unknown op names and a second implementation with the same
    (op, platform, name).
    Semantics: called on every plugin; the highest-priority usable implementation for the
    platform is chosen when the model is built, unless ``--custom-ops op=name`` overrides it.
    """


@hookspec
def backplane_register_spec_algorithms(register: Callable[[SpecAlgorithmSpec], None]) -> None:
    """Register speculative-decoding algorithms (selected by ``--speculative-algorithm NAME``).

    When: once, during plugin discovery.
    Must: call ``register(SpecAlgorithmSpec(...))`` once per algorithm.
    Params: register -- validates at once; duplicate names are errors naming both plugins.
    Semantics: called on every plugin; return values are ignored.
    """


@hookspec
def backplane_register_models(register: Callable[[ModelSpec], None]) -> None:
    """Register model classes by Hugging Face architecture name (``config.architectures[0]``).

    When: once, during plugin discovery.
    Must: call ``register(ModelSpec(architecture=..., factory=...))``.
    Params: register -- validates at once; a duplicate architecture is an error naming both plugins.
    Semantics: called on every plugin; return values are ignored.
    """


@hookspec
def backplane_register_quant_methods(register: Callable[[QuantMethodSpec], None]) -> None:
    """Register quantization methods (selected by ``--quantization NAME|auto|none``).

    When: once, during plugin discovery.
    Must: call ``register(QuantMethodSpec(...))`` once per method, declaring the checkpoint formats
    it loads (the ``quant_method`` strings of config.json's ``quantization_config``) and importing
    nothing heavy (the factory imports its kernels when the model is built).
    Params: register -- validates at once; a name registered by two plugins must be pinned with
    ``--quantization NAME@PLUGIN``.
    Semantics: called on every plugin; return values are ignored. Under ``auto`` the
    highest-priority usable method that declares the checkpoint's ``quant_method`` is built.
    """


@hookspec
def backplane_register_moe_backends(register: Callable[[MoeBackendSpec], None]) -> None:
    """Register mixture-of-experts backends (selected by ``--moe-backend NAME|auto``).

    When: once, during plugin discovery.
    Must: call ``register(MoeBackendSpec(...))`` once per backend, declaring the platforms, dtypes,
    top-k and expert-count limits, graph and compile support and the quantization methods whose
    expert weights it computes with; import nothing heavy (the factory imports its kernels when a
    MoE model is built).
    Params: register -- validates at once; a name registered by two plugins must be pinned with
    ``--moe-backend NAME@PLUGIN``.
    Semantics: called on every plugin; return values are ignored. For a MoE model, ``auto`` builds
    the highest-priority usable backend; for a dense model none is built.
    """


@hookspec
def backplane_register_settings(register: Callable[[str, type], None]) -> None:
    """Register a group of plugin options.

    When: once, during plugin discovery, before the command line is parsed.
    Must: call ``register("group-name", PydanticModel)``; every field becomes a flag
    ``--group-name.field-name`` and an env var ``BACKPLANE_GROUP_NAME__FIELD_NAME``; the parsed
    model instance reaches the plugin's backend factory as ``ctx.options``.
    Params: register -- group names are unique across plugins; the model must be a pydantic
    BaseModel whose fields all have defaults.
    Semantics: called on every plugin; return values are ignored.
    """


@hookspec(historic=True)
def backplane_configure(settings: Any) -> None:
    """React to the final settings.

    When: once, after the command line and environment are parsed and validated (historic: a
    plugin registered later still receives the call).
    Must: validate cross-option constraints and raise ``ValueError`` with a one-line message
    naming the option when the settings cannot work with this plugin; may log warnings.
    Params: settings -- the final ``EngineArgs`` (read-only by convention).
    Semantics: called on every plugin; return values are ignored.
    """
