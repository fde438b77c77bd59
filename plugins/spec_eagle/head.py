"""The EAGLE draft head and its loader.

feature = layer(fc(cat(embed(token), target_feature)))      # [T, hidden]
logits  = lm_head(norm(feature)) with the target's lm_head

A checkpoint directory holds config.json (Llama-like, one layer) and safetensors with
`fc.weight` [hidden, 2 * hidden] (optionally `fc.bias`) and `layers.0.*` (or `model.layers.0.*`).
Optional: `embed_tokens.weight` (else the target's embedding is shared), `layers.0.input_layernorm`
(EAGLE checkpoints usually drop it: identity), `norm.weight` (else the feature is the residual sum).
A token map (`--eagle.token-map`, a saved list of token ids as SGLang takes) restricts the
draft to those tokens: the lm_head keeps their rows only, which each draft step then reads.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from backplane.layers import VocabParallelEmbedding
from backplane.layers import RMSNorm
from backplane.speculative import iterate_safetensors, llama_decoder_layer, load_config, load_named_weights

from .beams import top_logprobs


class EagleHead(nn.Module):
    """forward(input_ids [T], target_feature [T, H], positions [T], batch) -> feature [T, H]."""

    def __init__(self, config, model_ctx, target, *, own_embedding: bool, input_norm: bool,
                 final_norm: bool, fc_bias: bool):
        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias, dtype=model_ctx.dtype)
        self.layers = nn.ModuleList([llama_decoder_layer(config, 0, model_ctx)])
        if not input_norm:
            self.layers[0].input_layernorm = nn.Identity()
        self.norm = RMSNorm(hidden, config.rms_norm_eps, model_ctx, model_ctx.dtype) if final_norm else None
        if own_embedding:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, model_ctx.parallel, model_ctx.dtype)
        # NOTE: a tuple, not submodules: the target's weights are shared, never loaded here.
        self._target = (target.model.embed_tokens, target.lm_head)
        self.vocab_size = int(target.vocab_size)
        self.hot_ids: torch.Tensor | None = None  # the token map, when one restricts the draft's vocabulary
        self.hot_weight: torch.Tensor | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if hasattr(self, "embed_tokens") else self._target[0]
        return table(input_ids)

    def forward(self, input_ids, target_feature, positions, batch) -> torch.Tensor:
        x = self.fc(torch.cat([self.embed(input_ids), target_feature.to(self.fc.weight.dtype)], dim=-1))
        hidden, residual = self.layers[0](positions, x, None, batch)
        if self.norm is None:
            return hidden + residual
        return self.norm(hidden, residual)[0]

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        """feature [N, H] -> fp32 logits [N, vocab] through the target's lm_head."""
        return F.linear(feature, self._target[1].weight)[:, : self.vocab_size].float()

    def top_tokens(self, feature: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k best (log-probability, token id) after each feature [N, H]; among the token map's
        tokens only when one is set (log-probabilities normalised over them)."""
        if self.hot_ids is None:
            return top_logprobs(self.logits(feature), k)
        scores, index = top_logprobs(F.linear(feature, self.hot_weight).float(), k)
        return scores, self.hot_ids[index]

    def restrict_vocabulary(self, token_ids: torch.Tensor) -> None:
        """Draft only among `token_ids` (SGLang's --speculative-token-map): the lm_head keeps their
        rows, so each draft step reads len(token_ids) rows instead of the whole vocabulary."""
        weight = self._target[1].weight
        self.hot_ids = token_ids.to(weight.device, torch.int64)
        self.hot_weight = weight.index_select(0, self.hot_ids).contiguous()


def load_token_map(path: str, vocab_size: int, flag: str = "--eagle.token-map") -> torch.Tensor:
    """The token ids of a token map file (a saved tensor or list of ids, as SGLang's), sorted and
    without duplicates; a clear ValueError naming `flag` for a missing file or ids outside the vocabulary."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"{flag} {path!r}: no such file; expected a .pt file holding a "
                         "tensor or list of token ids")
    try:
        values = torch.as_tensor(torch.load(file, map_location="cpu", weights_only=True))
    except Exception as exc:  # noqa: BLE001 - any unreadable content (a text file) gets the same clear message
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ValueError(f"{flag} {path!r}: expected a tensor or list of token ids saved with "
                         f"torch.save, could not read it: {type(exc).__name__}: {first}") from exc
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise ValueError(f"{flag} {path!r}: expected integer token ids, got {values.dtype}")
    ids = values.to(torch.int64).view(-1)
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        got = f"{ids.numel()} ids" + (f" in [{int(ids.min())}, {int(ids.max())}]" if ids.numel() else "")
        raise ValueError(f"{flag} {path!r}: expected token ids in [0, {vocab_size}), got {got}")
    return torch.unique(ids)


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, tensor in iterate_safetensors(path):
        tensors[name.removeprefix("model.")] = tensor
    return tensors


def _check_embedding(weight: torch.Tensor | None, expected: tuple[int, int], flag: str, path: str) -> None:
    """A draft's own embedding must index the target's vocabulary: one line naming the draft and flag."""
    if weight is not None and tuple(weight.shape) != expected:
        raise ValueError(f"{flag} {path!r}: embed_tokens.weight has shape {tuple(weight.shape)}; expected "
                         f"{expected} (the target's vocabulary by the draft's hidden size)")


def load_eagle_head(path: str, target, model_ctx, flag: str = "--eagle.draft-model") -> EagleHead:
    """Build an EagleHead from the checkpoint directory `path`, sharing the target's embedding and
    lm_head; a bad checkpoint is a ValueError naming `flag`."""
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise ValueError(f"{flag} {path!r}: expected a directory with config.json and "
                         "safetensors (the EAGLE checkpoint layout)")
    config = load_config(folder)
    if int(config.num_hidden_layers) != 1 or int(config.hidden_size) != int(target.hidden_size):
        raise ValueError(f"{flag} {path!r}: expected one layer of hidden size "
                         f"{target.hidden_size} (the target's), got {config.num_hidden_layers} layers of "
                         f"{config.hidden_size}")
    tensors = _checkpoint_tensors(folder)
    tensors.pop("lm_head.weight", None)  # the target's lm_head is used
    if "fc.weight" not in tensors:
        raise ValueError(f"{flag} {path!r}: no 'fc.weight' tensor; got {sorted(tensors)[:6]}")
    _check_embedding(tensors.get("embed_tokens.weight"), (int(target.vocab_size), int(config.hidden_size)), flag, path)
    with torch.device(model_ctx.device):
        head = EagleHead(config, model_ctx, target, own_embedding="embed_tokens.weight" in tensors,
                         input_norm="layers.0.input_layernorm.weight" in tensors,
                         final_norm="norm.weight" in tensors, fc_bias="fc.bias" in tensors)
    head.to(model_ctx.dtype)
    load_named_weights(head, tensors.items(), strict=True)
    return head.eval()
