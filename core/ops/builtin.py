"""The builtin plugin that registers the native custom ops, through the same hook as any plugin."""

from backplane.plugin.hookspecs import hookimpl
from backplane.ops.native import NATIVE_OPS
from backplane.plugin.registry import CustomOpImpl


@hookimpl
def backplane_register_custom_ops(register):
    for platform in ("cpu", "cuda"):
        for op, fn in NATIVE_OPS.items():
            register(CustomOpImpl(op=op, platform=platform, fn=fn, name="native", priority=0,
                                  compile_safe=True))
