"""Shared test helpers: tiny random Hugging Face models and hand-built ForwardBatches over real pools."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backplane.contracts.batch import ForwardBatch, ForwardMode
from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool

# Tiny shapes shared by every architecture; vocab 300 holds the byte tokenizer's ids.
TINY_SHAPE = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=512,
    rms_norm_eps=1e-6, tie_word_embeddings=False,
)


def tiny_hf_config(architecture: str, **overrides):
    """A small transformers config for `architecture` with the variant's distinguishing feature on."""
    import transformers

    shape = {**TINY_SHAPE}
    if architecture == "LlamaForCausalLM":
        cls = transformers.LlamaConfig
        shape.update(rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    elif architecture == "MistralForCausalLM":
        cls = transformers.MistralConfig
        shape.update(sliding_window=8)
    elif architecture == "Qwen2ForCausalLM":
        cls = transformers.Qwen2Config
        shape.pop("head_dim")
    elif architecture == "Qwen3ForCausalLM":
        cls = transformers.Qwen3Config
    else:
        raise ValueError(f"no tiny config for {architecture!r}")
    shape.update(overrides)
    return cls(**{"architectures": [architecture], **shape})


def make_hf_model(config, seed: int = 0):
    """The transformers model for `config` (fp32, eager attention, eval) with every weight random.

    Norm weights are 1 + noise and biases nonzero, so a missed weight or bias changes the logits.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.1 * torch.randn_like(param))
    return model.eval()


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation of `prompt`; returns (prompt + steps new tokens, fp32 logits of every position).

    logits: [len(prompt) + steps, vocab]; row t is the distribution of token t + 1.
    """
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
        logits = model(torch.tensor([ids])).logits[0].float()
    return ids, logits


@dataclass
class BatchBuilder:
    """Owns a request pool and a KV pool and writes ForwardBatches the way a scheduler would.

    Requests are numbered 0, 1, ... in the order of `add_request`; each remembers its row and how
    many of its tokens are in the KV cache.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_requests: int = 8
    max_context_len: int = 256
    num_slots: int = 2048
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    rows: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.req_pool = ReqToTokenPool(self.max_requests, self.max_context_len, self.device)
        self.kv_pool = TokenToKVPool(self.num_slots, self.num_layers, self.num_kv_heads, self.head_dim,
                                     self.dtype, self.device)

    @classmethod
    def for_model(cls, model, **kwargs) -> BatchBuilder:
        return cls(model.num_layers, model.num_kv_heads, model.head_dim, **kwargs)

    def add_request(self) -> int:
        self.rows.append(self.req_pool.alloc())
        self.cached.append(0)
        return len(self.rows) - 1

    def extend(self, reqs: list[int], tokens: list[list[int]], mode=ForwardMode.EXTEND, **extra) -> ForwardBatch:
        """New tokens for each request of `reqs` after its cached prefix (EXTEND-like modes)."""
        prefix = [self.cached[r] for r in reqs]
        batch = self._build(mode, reqs, tokens, **extra)
        batch.set_extend_lens(prefix, [len(t) for t in tokens])
        return batch

    def decode(self, reqs: list[int], tokens: list[int], **extra) -> ForwardBatch:
        """One new token per request."""
        return self._build(ForwardMode.DECODE, reqs, [[t] for t in tokens], **extra)

    def _build(self, mode: ForwardMode, reqs: list[int], tokens: list[list[int]], **extra) -> ForwardBatch:
        positions, locs = [], []
        for r, new in zip(reqs, tokens):
            start, row = self.cached[r], self.rows[r]
            slots = self.kv_pool.alloc(len(new))
            self.req_pool.req_to_token[row, start : start + len(new)] = slots.to(torch.int32)
            positions += range(start, start + len(new))
            locs.append(slots)
            self.cached[r] += len(new)
        seq_lens = [self.cached[r] for r in reqs]
        dev = self.device
        return ForwardBatch(
            forward_mode=mode,
            batch_size=len(reqs),
            input_ids=torch.tensor([t for new in tokens for t in new], dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            req_pool_indices=torch.tensor([self.rows[r] for r in reqs], dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
            out_cache_loc=torch.cat(locs).to(dev),
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.kv_pool,
            **extra,
        )


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    return float((actual - expected).abs().max() / expected.abs().max())


def count_computed_tokens(engine) -> list[int]:
    """Wrap the launcher's prefill: the list gets the number of new tokens of every prefill batch
    (whatever mode it reaches the runner in: a batch of one-token prefills runs as DECODE)."""
    counts, forward_prefill = [], engine.scheduler.launcher.forward_prefill

    def counting(reqs, chunks, *args, **options):
        counts.append(sum(chunks))
        return forward_prefill(reqs, chunks, *args, **options)

    engine.scheduler.launcher.forward_prefill = counting
    return counts


def unused_slots(engine) -> int:
    """KV slots no request holds: free ones plus those the prefix cache keeps for reuse. Call it
    between generate calls (then no request references the cache, which this checks)."""
    tree = engine.scheduler.prefix_cache.tree
    assert tree.protected_size == 0, "a finished request still references the prefix cache"
    return engine.runner.token_to_kv_pool.num_free + tree.total_size


def save_exact_eagle_head(model, path) -> str:
    """Save an EAGLE head (checkpoint layout) that reproduces the one-layer transformers `model`:
    fc picks the token embedding, then the model's own layer 0, final norm and lm_head, so a chain
    draft is fully accepted wherever the target is this model. Returns the directory."""
    import json

    from safetensors.torch import save_file

    hidden = model.config.hidden_size
    tensors = {"fc.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1),
               "norm.weight": model.model.norm.weight}
    tensors.update({f"layers.0.{k}": v for k, v in model.model.layers[0].state_dict().items()})
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    config = {**model.config.to_dict(), "architectures": ["LlamaForCausalLMEagle"], "num_hidden_layers": 1}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def save_feature_eagle_head(config, path, layer_scale: float = 0.02, seed: int = 0) -> str:
    """Save a one-layer Llama-architecture EAGLE head (checkpoint layout) for any target of `config`'s
    hidden size and vocabulary, where no exact copy exists (Gemma, MoE): fc passes the target's
    feature through (the token's embedding gets weight 0), the layer's weights are small random ones
    (`layer_scale` * randn: its attention and MLP run and nudge the feature), and there is no final
    norm, so the draft's logits are about the target's own logits of the previous position. Drafts
    are accepted where the target repeats a token; greedy output equals the target's either way.
    Returns the directory."""
    import json

    import transformers
    from safetensors.torch import save_file

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    llama = transformers.LlamaConfig(
        hidden_size=config.hidden_size, intermediate_size=config.hidden_size * 2, num_hidden_layers=1,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=head_dim, vocab_size=config.vocab_size, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps, rope_theta=10000.0, architectures=["LlamaForCausalLMEagle"])
    torch.manual_seed(seed)
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(llama, 0)
    hidden = config.hidden_size
    tensors = {"fc.weight": torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], 1)}
    for name, param in layer.state_dict().items():
        norm = name.endswith("norm.weight")
        tensors[f"layers.0.{name}"] = torch.ones_like(param) if norm else layer_scale * torch.randn_like(param)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(llama.to_dict()))
    return str(path)


def forward_logits(engine, prompts: list[list[int]], next_tokens: list[int] | None = None):
    """fp32 logits of every prompt token (one prefill batch of all prompts, built as the scheduler
    builds one, through the engine's model runner) and, given `next_tokens`, of one decode step over
    all prompts after them (else None); the pools are given back after."""
    from backplane import SamplingParams
    from backplane.scheduler.batch_builder import build_decode_batch, build_extend_batch
    from backplane.scheduler.request import Req

    runner = engine.runner
    kv_pool, req_pool = runner.token_to_kv_pool, runner.req_to_token_pool
    engine.scheduler.prefix_cache.clear()  # the forwards below allocate from the pools directly
    reqs = [Req(i, list(p), SamplingParams()) for i, p in enumerate(prompts)]
    for req in reqs:
        req.row = req_pool.alloc()
    try:
        batch = build_extend_batch(reqs, [len(p) for p in prompts], kv_pool, req_pool)
        batch.logits_indices = torch.arange(batch.num_tokens, device=runner.device)
        prefill = runner.forward(batch).logits.float().cpu()
        if next_tokens is None:
            return prefill, None
        for req, token in zip(reqs, next_tokens):
            req.num_cached = len(req.prompt_ids)
            req.output_ids.append(token)
        decode = runner.forward(build_decode_batch(reqs, kv_pool, req_pool)).logits.float().cpu()
        return prefill, decode
    finally:
        for req in reqs:
            kv_pool.free(torch.cat(req.slots))
            req_pool.free(req.row)


def save_llama_and_eagle(path, *, num_hidden_layers: int = 1, hidden_size: int = 64, intermediate_size: int = 96,
                         num_attention_heads: int = 2, num_key_value_heads: int = 1, head_dim: int = 32) -> tuple[str, str]:
    """A small random Llama saved under path/model and an EAGLE head reproducing it under path/eagle
    (defaults: one layer, head dim 32, which the triton kernels serve); returns both directories."""
    config = tiny_hf_config("LlamaForCausalLM", num_hidden_layers=num_hidden_layers, hidden_size=hidden_size,
                            intermediate_size=intermediate_size, num_attention_heads=num_attention_heads,
                            num_key_value_heads=num_key_value_heads, head_dim=head_dim)
    model = make_hf_model(config)
    model.save_pretrained(path / "model", safe_serialization=True)
    return str(path / "model"), save_exact_eagle_head(model, path / "eagle")


def save_gpu_llama(path, num_hidden_layers: int = 1, hidden_size: int = 256, num_attention_heads: int = 4,
                   num_key_value_heads: int = 2):
    """A random Llama of the GPU tests (default: hidden 256, 4 query and 2 KV heads of 64; MLP twice
    the hidden size, vocabulary 512, norms near 1 and weights of std 0.3, so that greedy tokens are
    decided) saved under `path`; returns the transformers model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads,
                         vocab_size=512, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else 0.3 * torch.randn_like(param))
    model.save_pretrained(path, safe_serialization=True)
    return model


def count_graph_replays(graphs) -> list[tuple]:
    """Wrap `graphs.replay` (an instance attribute shadowing the method): the list gets every
    replay's (batch mode, real batch size, graph key)."""
    calls, replay = [], graphs.replay

    def counted(batch, key=None):
        key = key or graphs.key_for(batch)
        calls.append((batch.forward_mode, batch.batch_size, key))
        return replay(batch, key)

    graphs.replay = counted
    return calls
