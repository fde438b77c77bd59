"""Our Llama-family models against Hugging Face transformers on tiny random configs (CPU, fp32).

Each model is saved by transformers as safetensors, loaded back through our loader, and run with
the torch_native backend over real pools: a mixed prefill (one request split into two chunks, so
the second extends a cached prefix), then greedy decode steps. One causal transformers forward
per finished sequence gives the reference logits at every position, and its argmax must pick the
same greedy tokens as ours.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers_models import BatchBuilder, make_hf_model, relative_error, tiny_hf_config

from backplane.attention.torch_native import TorchNativeAttnBackend
from backplane.models import builtin as models_builtin
from backplane.models.base import ModelContext
from backplane.models.loader import get_model_spec, iterate_safetensors, load_hf_config

ARCHITECTURES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
PROMPT_LENS = [11, 3, 20]  # the 20-token request is prefilled in two chunks of 12 and 8
DECODE_STEPS = 20
TOLERANCE = 1e-4


def registered_models() -> dict:
    specs = {}
    models_builtin.backplane_register_models(register=lambda spec: specs.__setitem__(spec.architecture, spec))
    return specs


def load_ours(path, dtype=torch.float32, device="cpu"):
    """Build our model for the directory `path` the way the model runner does."""
    config = load_hf_config(path)
    ctx = ModelContext(dtype=dtype, device=device)
    model = get_model_spec(registered_models(), config).factory(config, ctx)
    model.load_weights(iterate_safetensors(path))
    ctx.attn_backend = TorchNativeAttnBackend(None)
    return model


def random_prompts(seed: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def saved(request, tmp_path_factory):
    """(architecture, HF model, its directory) for each architecture."""
    config = tiny_hf_config(request.param)
    hf = make_hf_model(config, seed=ARCHITECTURES.index(request.param))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, path


@torch.no_grad()
def run_greedy(model, prompts, steps):
    """Prefill, then `steps` greedy decode steps, all requests in one batch.

    Returns (full token sequences, per forward: (name, logits, the position each row predicts from)).
    """
    builder = BatchBuilder.for_model(model)
    reqs = [builder.add_request() for _ in prompts]
    sequences = [list(p) for p in prompts]
    long = prompts[2]
    first = model(builder.extend(reqs, [prompts[0], prompts[1], long[:12]])).logits
    second = model(builder.extend([reqs[2]], [long[12:]])).logits
    records = [("prefill", first, [len(prompts[0]) - 1, len(prompts[1]) - 1, 11]),
               ("prefill chunk 2", second, [None, None, len(long) - 1])]
    last = torch.stack([first[0], first[1], second[0]])
    for step in range(steps):
        for seq, token in zip(sequences, last.argmax(dim=-1).tolist()):
            seq.append(token)
        last = model(builder.decode(reqs, [seq[-1] for seq in sequences])).logits
        records.append((f"decode {step}", last, [len(seq) - 1 for seq in sequences]))
    return sequences, records


def test_logits_match_transformers(saved):
    """Every forward's logits match transformers' on the same tokens, and greedy picks agree."""
    architecture, hf, path = saved
    model = load_ours(path)
    assert type(model).__name__ == architecture
    prompts = random_prompts(1, hf.config.vocab_size)
    sequences, records = run_greedy(model, prompts, DECODE_STEPS)
    with torch.no_grad():  # one causal forward per request gives transformers' logits at every position
        hf_logits = [hf(torch.tensor([seq])).logits[0].float() for seq in sequences]
    for seq, prompt, logits in zip(sequences, prompts, hf_logits):
        assert seq[len(prompt):] == logits[len(prompt) - 1 : -1].argmax(dim=-1).tolist(), "greedy tokens differ"
    for name, logits, rows in records:
        expected = torch.stack([hf_logits[i][row] for i, row in enumerate(rows) if row is not None])
        assert logits.dtype == torch.float32 and logits.shape == expected.shape, name
        err = relative_error(logits, expected)
        assert err < TOLERANCE, f"{architecture} {name}: relative error {err:.2e}"


def test_capture_hidden_matches_transformers_last_hidden_state(saved):
    architecture, hf, path = saved
    model = load_ours(path)
    prompt = random_prompts(2, hf.config.vocab_size)[2]
    builder = BatchBuilder.for_model(model)
    batch = builder.extend([builder.add_request()], [prompt])
    with torch.no_grad(), model.ctx.bind(model.ctx.context_for(batch, capture_hidden=True)):
        out = model(batch)
        expected = hf.model(torch.tensor([prompt])).last_hidden_state[0]
    assert out.hidden_states.shape == (len(prompt), hf.config.hidden_size)
    assert relative_error(out.hidden_states, expected) < TOLERANCE
    no_capture = model(builder.decode([0], [5]))
    assert no_capture.hidden_states is None


def test_sliding_window_changes_mistral_logits(tmp_path):
    """Guards the Mistral comparison: without the window our logits must differ from transformers'."""
    config = tiny_hf_config("MistralForCausalLM")
    hf = make_hf_model(config, seed=7)
    hf.save_pretrained(tmp_path)
    prompt = random_prompts(3, config.vocab_size)[2]  # 20 tokens > window 8
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    errors = {}
    for window in (8, None):
        model = load_ours(tmp_path)
        for layer in model.model.layers:
            info = layer.self_attn.attn.info
            layer.self_attn.attn.info = dataclasses.replace(info, sliding_window=window or 0)
        builder = BatchBuilder.for_model(model)
        with torch.no_grad():
            errors[window] = relative_error(model(builder.extend([builder.add_request()], [prompt])).logits[0], expected)
    assert errors[8] < TOLERANCE
    assert errors[None] > 1e-3


def test_sharded_checkpoint_with_tied_embeddings(tmp_path):
    config = tiny_hf_config("LlamaForCausalLM", tie_word_embeddings=True)
    hf = make_hf_model(config, seed=3)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    model = load_ours(tmp_path)
    assert model.lm_head is model.model.embed_tokens
    prompts = random_prompts(4, config.vocab_size)
    builder = BatchBuilder.for_model(model)
    with torch.no_grad():
        logits = model(builder.extend([builder.add_request() for _ in prompts], prompts)).logits
        expected = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    assert relative_error(logits, expected) < TOLERANCE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-3), (torch.bfloat16, 5e-2)])
def test_llama_on_cuda_matches_transformers_on_cpu(tmp_path, dtype, tolerance):
    config = tiny_hf_config("LlamaForCausalLM")
    hf = make_hf_model(config, seed=5)
    hf.save_pretrained(tmp_path)
    model = load_ours(tmp_path, dtype=dtype, device="cuda")
    prompts = random_prompts(6, config.vocab_size)
    builder = BatchBuilder.for_model(model, dtype=dtype, device="cuda")
    reqs = [builder.add_request() for _ in prompts]
    with torch.no_grad():
        prefill = model(builder.extend(reqs, prompts)).logits
        decode = model(builder.decode(reqs, [5, 6, 7])).logits
        expected_prefill = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
        expected_decode = torch.stack([hf(torch.tensor([p + [t]])).logits[0, -1] for p, t in zip(prompts, [5, 6, 7])])
    assert prefill.dtype == torch.float32 and prefill.device.type == "cuda"
    assert relative_error(prefill.cpu(), expected_prefill) < tolerance
    assert relative_error(decode.cpu(), expected_decode) < tolerance
