"""Deprecated: the first release's `backplane.memory`. The pools are public from `backplane` itself
(`from backplane import ReqToTokenPool`) since backplane 0.2 (plugin API 1.1); this alias goes in 0.3."""

from backplane.deprecation import renamed_names

__getattr__ = renamed_names(__name__, {
    "ReqToTokenPool": "backplane.ReqToTokenPool",
    "TokenToKVPool": "backplane.TokenToKVPool",
    "PoolExhaustedError": "backplane.contracts.memory.PoolExhaustedError",
})
