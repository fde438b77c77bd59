"""Models: the Llama family, checkpoint loading, presets, and the public half of the model API.

Public for model plugins (with the layers of backplane.layers):
- `ModelContext`: what every layer of a model is built with; `model_ctx.forward` is the
  ForwardContext of the forward now running (`capture_hidden`, `logits_out`), None between forwards
- `ModelOutput`: what a model's forward returns (from backplane.contracts)
- `load_named_weights`, `STACKED_PARAMS`: checkpoint tensors onto fused, rank-local parameters
- Llama-family config readers: `head_dim_of`, `num_kv_heads_of`, `rope_settings`, `sliding_window_of`
- `llama_checkpoint_shapes`: the names and full shapes of a Llama-family checkpoint
"""

from backplane.contracts.model import ModelOutput
from backplane.models.base import ModelContext
from backplane.models.config_utils import head_dim_of, num_kv_heads_of, rope_settings, sliding_window_of
from backplane.models.weights import STACKED_PARAMS, llama_checkpoint_shapes, load_named_weights

__all__ = [
    "ModelContext", "ModelOutput", "STACKED_PARAMS", "head_dim_of", "llama_checkpoint_shapes", "load_named_weights",
    "num_kv_heads_of", "rope_settings", "sliding_window_of",
]
