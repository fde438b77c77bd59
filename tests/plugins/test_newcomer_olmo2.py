"""The newcomer exercise of issue 40: examples/olmo2_plugin, written from the docs alone, passes the
model conformance suite against transformers' Olmo2ForCausalLM and imports only public modules."""

import sys
from pathlib import Path

import pytest
import transformers

from backplane.testing import model_conformance
from backplane.testing.boundary import check_plugin_imports

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "olmo2_plugin"
sys.path.insert(0, str(EXAMPLE))  # the example is not installed: register its module object instead

import backplane_olmo2  # noqa: E402

test_olmo2 = model_conformance.make_suite("Olmo2ForCausalLM", transformers.Olmo2Config, plugins=(backplane_olmo2,))


def test_olmo2_imports_only_public_modules():
    assert check_plugin_imports(EXAMPLE / "backplane_olmo2", "backplane_olmo2") == []


@pytest.mark.parametrize("tp_size", [2, 4])
def test_olmo2_tensor_parallel_matches_transformers(tmp_path, tp_size):
    """Ranks on the CPU: q and k split by heads, so the whole-vector q/k norms sum over ranks; at 4 ranks
    the 2 KV heads are replicated, each on two ranks, and k_norm's weight must follow that placement."""
    import torch

    from backplane import Engine, SamplingParams

    torch.manual_seed(0)
    config = transformers.Olmo2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      pad_token_id=0, eos_token_id=1)
    reference = transformers.Olmo2ForCausalLM(config).eval()
    with torch.no_grad():  # random norm weights, so a shard loaded from the wrong slice shows
        for name, param in reference.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    reference.save_pretrained(tmp_path)
    prompts = [[5, 9, 22, 7, 100, 3, 41], [17, 4, 4, 90]]
    engine = Engine(model=str(tmp_path), device="cpu", tp_size=tp_size, plugins=[backplane_olmo2])
    try:
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
    finally:
        engine.shutdown()
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logprobs = reference(ids).logits[0].float().log_softmax(-1)
        steps = range(len(prompt) - 1, ids.shape[1] - 1)
        expected = [logprobs[i].argmax().item() for i in steps]
        assert out.token_ids == expected
        chosen = torch.tensor([logprobs[i, ids[0, i + 1]].item() for i in steps])
        torch.testing.assert_close(torch.tensor(out.logprobs), chosen, atol=2e-4, rtol=0)
