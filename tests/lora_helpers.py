"""Shared by the LoRA serving tests (CPU and GPU): a tiny random Llama, PEFT adapters of several
ranks and targets made with peft, the merged transformers references, and one-forward helpers."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backplane.scheduler.batch_builder import build_decode_batch, build_extend_batch
from backplane.scheduler.request import Req
from backplane.scheduler.sampling_params import SamplingParams
from backplane.contracts.batch import ForwardMode
from backplane.executor.graph_runner import GraphRunner, pad_into
from backplane.contracts.model import ModelOutput
from helpers_models import make_hf_model, tiny_hf_config

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Different ranks, alphas and targets; one rank-stabilised. B is random (init_lora_weights=False).
ADAPTERS = {
    "all7_r4": dict(r=4, lora_alpha=8, target_modules=ALL_SEVEN),
    "qv_down_r8": dict(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True),
    "kogu_r2": dict(r=2, lora_alpha=3, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"]),
}


@dataclass
class LoraWorld:
    """base_dir: the saved base model; adapter_dirs: name -> PEFT directory; merged: name -> the
    transformers model with that adapter merged in (None -> the base model)."""

    base_dir: Path
    adapter_dirs: dict[str, Path]
    merged: dict[str | None, torch.nn.Module] = field(default_factory=dict)

    def lora_paths(self, names=None) -> list[str]:
        return [f"{n}={self.adapter_dirs[n]}" for n in (names or self.adapter_dirs)]


def make_lora_world(root: Path, adapters: dict[str, dict] = ADAPTERS, **config_overrides) -> LoraWorld:
    return save_adapted(make_hf_model(tiny_hf_config("LlamaForCausalLM", **config_overrides), seed=0), root, adapters)


def save_adapted(base: torch.nn.Module, root: Path, adapters: dict[str, dict]) -> LoraWorld:
    """Save `base` under root/base and one PEFT adapter per entry of `adapters` (random A and B, moderate
    deltas) under root/<name>; the LoraWorld holds the base and each adapter merged into a copy.
    (make_lora_world draws them for a tiny Llama.)"""
    from peft import LoraConfig, get_peft_model

    base_dir = root / "base"
    base.save_pretrained(base_dir, safe_serialization=True)
    world = LoraWorld(base_dir, {}, {None: base})
    for i, (name, cfg) in enumerate(adapters.items()):
        torch.manual_seed(100 + i)
        peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **cfg))
        with torch.no_grad():  # moderate deltas: visible in the logits, no saturation
            for pname, param in peft_model.named_parameters():
                if "lora_" in pname:
                    param.copy_(0.3 * torch.randn_like(param) / param.shape[-1] ** 0.5)
        world.adapter_dirs[name] = root / name
        peft_model.save_pretrained(world.adapter_dirs[name])
        world.merged[name] = peft_model.merge_and_unload().eval()
    return world


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), vocab] of a transformers model."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def forward_requests(engine, prompts: list[list[int]], adapters: list[str | None],
                     next_tokens: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One mixed prefill (logits of every prompt token) and, with next_tokens, one mixed decode step.

    Goes through the engine's runner and LoRA manager the way the scheduler does.
    Returns (prefill logits [sum(len(p)), vocab], decode logits [len(prompts), vocab] or None).
    """
    runner, manager = engine.runner, engine.lora_manager
    kv_pool, req_pool = runner.token_to_kv_pool, runner.req_to_token_pool
    engine.scheduler.prefix_cache.clear()  # the forwards below allocate from the pool directly
    reqs = [Req(i, list(p), SamplingParams(), a) for i, (p, a) in enumerate(zip(prompts, adapters))]
    for req in reqs:
        req.row = req_pool.alloc()
    try:
        batch = build_extend_batch(reqs, [len(p) for p in prompts], kv_pool, req_pool)
        batch.logits_indices = torch.arange(batch.num_tokens, device=runner.device)
        manager.prepare_batch(batch, reqs)
        for req in reqs:
            req.num_cached = len(req.prompt_ids)
        prefill = runner.forward(batch).logits.float().cpu()
        decode = None
        if next_tokens is not None:
            for req, token in zip(reqs, next_tokens):
                req.output_ids.append(token)
            batch = build_decode_batch(reqs, kv_pool, req_pool)
            manager.prepare_batch(batch, reqs)
            decode = runner.forward(batch).logits.float().cpu()
        return prefill, decode
    finally:
        for req in reqs:
            kv_pool.free(torch.cat(req.slots))
            req_pool.free(req.row)


class EagerReplayGraphs(GraphRunner):
    """The graph runner with each CUDA graph replaced by running the model on the padded static
    view: keys, padding and the LoRA manager's capture/replay binding run on CPU, for real.
    (Attention runs its eager metadata path: torch_native attention has no graph support.)"""

    def capture(self) -> None:
        for key in self.keys():
            self.prepare_contributors(self._capture_batch(key), key)
            self.graphs[key] = None

    def replay(self, batch, key=None):
        key = key or self.key_for(batch)
        padded = pad_into(self.static, batch, key, self.pad_row, self.fill)
        bindings = self.prepare_contributors(padded, key, real=batch)  # what the captured kernels read
        self.backend.init_forward_metadata(padded)
        self.replayed.append(key)
        model_ctx = self.ctx.model_ctx
        with model_ctx.bind(model_ctx.context_for(padded, attn_backend=self.backend, bindings=bindings, graph_key=key)):
            return ModelOutput(self.model(padded).logits[: batch.num_tokens])


def with_fake_graphs(engine) -> EagerReplayGraphs:
    runner = engine.runner
    runner.attn_backend.init_graph_state = lambda *args: None  # eager attention, see EagerReplayGraphs
    graphs = EagerReplayGraphs(runner.graph_context(), [ForwardMode.DECODE])
    graphs.replayed = []
    graphs.capture()
    runner.graph_runner = graphs
    return graphs
