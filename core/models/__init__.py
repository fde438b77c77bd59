"""Model classes (the Llama family), checkpoint loading, dummy-weight presets and the byte tokenizer.

Public for plugins: `ModelContext`, what every layer of a model is built with.
"""

from backplane.models.base import ModelContext

__all__ = ["ModelContext"]
