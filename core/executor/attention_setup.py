"""Choosing and building a model runner's attention backend(s).

Prefill (with the speculative modes) and decode are selected separately (--prefill-attention-backend,
--decode-attention-backend, both defaulting to --attention-backend), each built through build_first
so that under `auto` a factory that fails gives way to the next usable backend. One backend serves
both when both roles chose the same; otherwise a HybridAttnBackend routes each batch to its role's."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backplane.attention.hybrid import HybridAttnBackend
from backplane.contracts.attention import AttentionBackend, AttentionBackendContext, AttentionLayerInfo
from backplane.contracts.memory import ReqToTokenPool, TokenToKVPool
from backplane.executor.resources import dtype_name
from backplane.plugin.registry import Registry
from backplane.plugin.runtime import build_first
from backplane.plugin.selection import AttentionRequirements, Selection, select_attention_backend
from backplane.settings import EngineArgs


@dataclass(frozen=True)
class AttentionSetup:
    """What choosing and building the attention backends reads: the settings, the registry, the
    model's attention layers, where it runs, and the pools the backends read and write."""

    args: EngineArgs
    registry: Registry
    layer_infos: list[AttentionLayerInfo]
    device: torch.device
    dtype: torch.dtype
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool

    def requirements(self, modes: tuple[str, ...]) -> AttentionRequirements:
        """What a backend serving `modes` for this model must support (an FP8 pool: a backend that
        declares kv_cache_dtypes fp8_e4m3)."""
        info = self.layer_infos[0]
        return AttentionRequirements(
            platform=self.device.type, dtype=dtype_name(self.dtype), head_dim=info.head_dim, modes=modes,
            sliding_window=any(i.sliding_window > 0 for i in self.layer_infos),
            logit_softcap=any(i.logit_softcap > 0 for i in self.layer_infos),
            custom_mask="target_verify" in modes,
            kv_cache_dtype=self.args.kv_cache_dtype if self.token_to_kv_pool.is_fp8 else "auto",
        )

    def build(self) -> tuple[AttentionBackend, dict[str, Selection]]:
        """The backend the model runs and the selection of each role ("prefill", "decode"), as built."""
        args = self.args
        spec_modes = ("target_verify", "draft_extend") if args.speculative_algorithm else ()
        prefill_name = args.prefill_attention_backend or args.attention_backend
        decode_name = args.decode_attention_backend or args.attention_backend
        prefill_flag = "--prefill-attention-backend" if args.prefill_attention_backend else "--attention-backend"
        decode_flag = "--decode-attention-backend" if args.decode_attention_backend else "--attention-backend"
        choices = {
            "prefill": select_attention_backend(self.registry, prefill_name,
                                                self.requirements(("extend", *spec_modes)), prefill_flag),
            "decode": select_attention_backend(self.registry, decode_name, self.requirements(("decode",)), decode_flag),
        }
        prefill, choices["prefill"] = build_first(choices["prefill"], self.backend_context, kind="attention")
        same = choices["decode"].spec is choices["prefill"].spec
        decode, choices["decode"] = ((prefill, choices["prefill"]) if same else
                                     build_first(choices["decode"], self.backend_context, kind="attention"))
        return (prefill if same else HybridAttnBackend(prefill, decode)), choices

    def backend_context(self, choice: Selection) -> AttentionBackendContext:
        """What the factory of `choice` is called with (its plugin's options group, if it has one)."""
        info = self.layer_infos[0]
        group = self.registry.options_group(choice.plugin)
        return AttentionBackendContext(
            num_heads=info.num_heads, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
            num_layers=len(self.layer_infos), dtype=self.dtype, device=self.device,
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.token_to_kv_pool,
            max_context_len=self.req_to_token_pool.max_context_len,
            options=self.args.options_for(group) if group else None, server_args=self.args,
        )
