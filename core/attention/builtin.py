"""The builtin plugin that registers the torch_native attention backend, like any other plugin."""

from backplane.attention.torch_native import SPEC
from backplane.plugin.hookspecs import hookimpl


@hookimpl
def backplane_register_attention_backends(register):
    register(SPEC)
