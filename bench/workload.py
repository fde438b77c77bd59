"""What the benchmarks feed the engine: request shapes, random token-id prompts, the sizes a floor
is computed from, and dummy PEFT adapters."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shapes(kind: str, n: int, fixed_shape: tuple[int, int] = (1024, 256), seed: int = 0) -> list[tuple[int, int]]:
    """(input, output) lengths of n requests: "fixed", or "sharegpt-like" (seeded log-normal lengths, a chat-like mix)."""
    if kind == "fixed":
        return [tuple(fixed_shape)] * n
    if kind != "sharegpt-like":
        raise ValueError(f"workload {kind!r}: expected fixed or sharegpt-like")
    rng = random.Random(seed)

    def clamp(v: float, lo: int, hi: int) -> int:
        return max(lo, min(hi, int(v)))

    return [(clamp(rng.lognormvariate(5.5, 1.0), 4, 2048), clamp(rng.lognormvariate(5.0, 0.8), 4, 512)) for _ in range(n)]


def prompts(lengths: list[int], vocab: int, seed: int = 1) -> list[list[int]]:
    """Random token ids in [3, vocab), one prompt per length; another seed shares no prefix with these."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def shared_prefix(groups: int, per_group: int, prefix: int, suffix: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """groups x per_group prompts, shuffled: a group shares a `prefix`-token prefix, each adds its own `suffix`."""
    heads = prompts([prefix] * groups, vocab, seed)
    tails = prompts([suffix] * (groups * per_group), vocab, seed + 1)
    out = [heads[i // per_group] + tail for i, tail in enumerate(tails)]
    random.Random(seed).shuffle(out)
    return out


def model_sizes(config, dtype_bytes: int = 2) -> tuple[int, int]:
    """(KV bytes per token, parameters of the per-token matmuls: q/k/v/o and gate/up/down of every
    layer; the lm_head runs once per request in a prefill, so it is left out) of a Llama-family config."""
    projections, layers = projection_shapes(config), config.num_hidden_layers
    kv = projections["k_proj"][1]
    return layers * 2 * kv * dtype_bytes, layers * sum(n_in * n_out for n_in, n_out in projections.values())


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, each storage once (a tied embedding counts once): what a
    decode step's weight-read floor reads."""
    params = {p.data_ptr(): p for p in model.parameters()}
    return sum(p.numel() * p.element_size() for p in params.values())


def projection_shapes(config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of a Llama-family config."""
    from backplane.models.config_utils import head_dim_of, num_kv_heads_of

    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim_of(config), num_kv_heads_of(config) * head_dim_of(config)
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def write_dummy_adapter(path: Path, config, rank: int, seed: int) -> None:
    """A PEFT adapter directory with random A [r, in] and B [out, r] for every projection of every layer."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for proj, (n_in, n_out) in projection_shapes(config).items():
            block = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, n_in, generator=gen) / n_in**0.5).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (0.01 * torch.randn(n_out, rank, generator=gen)).to(torch.bfloat16)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config_json = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS),
                   "bias": "none", "use_rslora": False}
    (path / "adapter_config.json").write_text(json.dumps(config_json))
