"""The core's builtin plugin for LoRA: registers the torch_native reference backend."""

from backplane.plugin.hookspecs import hookimpl


@hookimpl
def backplane_register_lora_backends(register):
    from backplane.lora.torch_native import SPEC

    register(SPEC)
