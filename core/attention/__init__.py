"""Attention: the AttentionBackend contract and the builtin torch_native reference backend."""

from backplane.contracts.attention import AttentionBackend, AttentionBackendContext, AttentionLayerInfo


def __getattr__(name):
    if name == "TorchNativeAttnBackend":
        from backplane.attention.torch_native import TorchNativeAttnBackend

        return TorchNativeAttnBackend
    raise AttributeError(name)


__all__ = ["AttentionBackend", "AttentionBackendContext", "AttentionLayerInfo", "TorchNativeAttnBackend"]
