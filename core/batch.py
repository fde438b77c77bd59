"""Deprecated: the first release's `backplane.batch`. Its names are public from `backplane` itself
(`from backplane import ForwardMode`) since backplane 0.2 (plugin API 1.1); this alias goes in 0.3."""

from backplane.deprecation import renamed_names

__getattr__ = renamed_names(__name__, {"ForwardBatch": "backplane.ForwardBatch", "ForwardMode": "backplane.ForwardMode"})
