"""The names of the custom ops that plugins may implement."""

OP_NAMES = (
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "gelu_and_mul",
    "gelu",
    "quick_gelu",
    "rotary_embedding",
    "rotary_kv_write",  # rotary fused with the KV-cache write; used only by backends that opt in
    "greedy_sample",  # argmax of each logits row and its log-probability; the sampler's all-greedy batches
    "moe_route",  # a MoE layer's router: softmax, top-k, renormalisation; FusedMoE calls it
)
