"""`backplane serve` against a live server (one per module): the official openai client does
completions, chat and streaming; greedy HTTP output equals Engine.generate token for token; 64
concurrent streams finish; a disconnect frees the KV pool at once; bad input gets OpenAI-style 400s.

The bad-input rows (H01...) are the "HTTP server" section of docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import jinja2
import openai
import pytest
import torch

from backplane import Engine, SamplingParams
from backplane.models.byte_tokenizer import ByteTokenizer
from helpers_server import CHAT_TEMPLATE, TINY, LiveServer

ADAPTER = "shout"
MAX_BODY = 100_000
NO_EOS = {"ignore_eos": True, "return_token_ids": True}


def write_adapter(path: Path, rank: int = 4, seed: int = 1) -> Path:
    """A PEFT LoRA adapter (q_proj, v_proj) for the tiny-llama preset's shapes, random A and B."""
    from safetensors.torch import save_file

    path.mkdir()
    g = torch.Generator().manual_seed(seed)
    dims = {"q_proj": (256, 256), "v_proj": (256, 128)}  # (in, out): 4 query heads, 2 KV heads of 64
    tensors = {}
    for layer in range(2):
        for proj, (d_in, d_out) in dims.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = 0.5 * torch.randn(rank, d_in, generator=g)
            tensors[f"{key}.lora_B.weight"] = 0.5 * torch.randn(d_out, rank, generator=g)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 8, "target_modules": list(dims)}))
    return path


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    return write_adapter(tmp_path_factory.mktemp("lora") / ADAPTER)


@pytest.fixture(scope="module")
def server(adapter_dir):
    live = LiveServer(*TINY, "--chat-template", str(CHAT_TEMPLATE), "--lora-paths", f"{ADAPTER}={adapter_dir}",
                      "--max-request-bytes", str(MAX_BODY))
    yield live
    assert live.terminate() == 0, live.output()
    live.stop()


@pytest.fixture(scope="module")
def engine(adapter_dir):
    """The offline engine on the same model and flags: the reference for every output."""
    return Engine("tiny-llama", device="cpu", attention_backend="torch_native", max_total_tokens=16384,
                  lora_paths=[f"{ADAPTER}={adapter_dir}"])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def chat_ids(messages: list[dict]) -> list[int]:
    """The test's own rendering of the chat template (jinja2 + the byte tokenizer)."""
    text = jinja2.Template(CHAT_TEMPLATE.read_text(), trim_blocks=True, lstrip_blocks=True).render(
        messages=messages, add_generation_prompt=True)
    return ByteTokenizer().encode(text)


def test_completion_greedy_equals_engine_generate(client, engine):
    prompts = [[1, 72, 105, 33], [1, 200, 7, 9, 300, 12]]
    out = client.completions.create(model="tiny-llama", prompt=prompts, max_tokens=12, temperature=0,
                                    extra_body=NO_EOS)
    ref = engine.generate(input_ids=prompts, sampling_params=greedy(12))
    assert [c.token_ids for c in out.choices] == [r.token_ids for r in ref]
    assert [c.text for c in out.choices] == [r.text for r in ref]
    assert [c.finish_reason for c in out.choices] == ["length", "length"]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (10, 24, 34)


def _stop_candidate(text: str) -> str | None:
    """Two characters after the first of `text`, none of them an incomplete byte (U+FFFD)."""
    return next((text[i:i + 2] for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2]), None)


def test_text_prompt_and_stop_string(client, engine):
    # random weights: take the first prompt whose greedy text has a stop string to cut at
    prompts = ["Hello", "The capital of France is", "abc"]
    refs = engine.generate(prompts, greedy(24))
    prompt, ref, stop = next((p, r, _stop_candidate(r.text)) for p, r in zip(prompts, refs) if _stop_candidate(r.text))
    kwargs = dict(model="tiny-llama", prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    assert client.completions.create(**kwargs).choices[0].text == ref.text
    cut = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert cut.finish_reason == "stop" and cut.text == ref.text[:ref.text.find(stop)]
    streamed = list(client.completions.create(stop=[stop], stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed) == cut.text  # never past the stop string


def test_streamed_completion_equals_the_whole_one(client):
    kwargs = dict(model="tiny-llama", prompt=[1, 80, 81], max_tokens=16, temperature=0, extra_body=NO_EOS)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [t for c in chunks if c.choices for t in c.choices[0].token_ids] == whole.choices[0].token_ids
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_sse_framing_ends_with_done(server):
    body = {"prompt": [1, 5, 6], "max_tokens": 4, "stream": True, "n": 2, "temperature": 0}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    finished = sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"])
    assert finished == [0, 1]


def test_chat_completion_uses_the_chat_template(client, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ref = engine.generate(input_ids=[chat_ids(messages)], sampling_params=greedy(10))[0]
    out = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=10, temperature=0,
                                         logprobs=True, extra_body=NO_EOS)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.token_ids == ref.token_ids and out.usage.prompt_tokens == len(chat_ids(messages))
    assert [round(t.logprob, 4) for t in choice.logprobs.content] == [round(lp, 4) for lp in ref.logprobs]
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=10,
                                                 temperature=0, stream=True, extra_body=NO_EOS))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text


def test_models_lists_the_adapter_and_model_picks_it(client, engine):
    assert [m.id for m in client.models.list().data] == ["tiny-llama", ADAPTER]
    prompt = [1, 40, 41, 42]
    ref = engine.generate(input_ids=[prompt, prompt], sampling_params=greedy(8), lora=[ADAPTER, None])
    assert ref[0].token_ids != ref[1].token_ids  # the adapter changes the output
    out = client.completions.create(model=ADAPTER, prompt=prompt, max_tokens=8, temperature=0, extra_body=NO_EOS)
    assert out.choices[0].token_ids == ref[0].token_ids and out.model == ADAPTER


def test_seeded_sampling_repeats_and_n_differ(client):
    kwargs = dict(model="tiny-llama", prompt=[1, 9], max_tokens=8, temperature=1.0, top_p=0.9, seed=7, n=2,
                  extra_body={**NO_EOS, "top_k": 50, "min_p": 0.01})
    a, b = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.token_ids for c in a.choices] == [c.token_ids for c in b.choices]
    assert a.choices[0].token_ids != a.choices[1].token_ids  # copy i samples with seed + i


def test_64_concurrent_streaming_clients(server, engine):
    prompts = [[1, 3 + i, 3 + (7 * i) % 250, 100] for i in range(64)]
    ref = engine.generate(input_ids=prompts, sampling_params=greedy(8))

    async def one(client, prompt):
        stream = await client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, temperature=0,
                                                 stream=True, extra_body=NO_EOS)
        chunks = [c async for c in stream]
        return [t for c in chunks for t in c.choices[0].token_ids], chunks[-1].choices[0].finish_reason

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(run())
    assert [ids for ids, _ in results] == [r.token_ids for r in ref]
    assert {reason for _, reason in results} == {"length"}
    assert server.wait_metric("backplane_kv_cache_used_tokens", 0.0) == 0.0


def _aborted(server) -> float:
    return server.metrics().get('backplane_requests_finished_total{finish_reason="abort"}', 0.0)


def test_disconnect_mid_stream_frees_the_kv_pool(server):
    start, aborted = server.metrics()["backplane_kv_cache_used_tokens"], _aborted(server)
    body = {"prompt": [1, 5, 6, 7], "max_tokens": 1900, "stream": True, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(3):
            while not next(lines):
                pass
        assert server.metrics()["backplane_kv_cache_used_tokens"] > start
    # the connection is closed here, long before 1900 tokens
    assert server.wait_metric("backplane_kv_cache_used_tokens", start) == start
    assert server.metrics()["backplane_num_requests_running"] == 0 and _aborted(server) == aborted + 1


def test_a_client_timing_out_aborts_a_whole_request(server):
    start, aborted = server.metrics()["backplane_kv_cache_used_tokens"], _aborted(server)
    body = {"prompt": [1, 8], "max_tokens": 1900, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    assert server.wait_metric("backplane_kv_cache_used_tokens", start) == start
    assert _aborted(server) == aborted + 1


def test_metrics_count_tokens_and_latencies(server):
    before = server.metrics()
    httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 5, "ignore_eos": True})
    after = server.metrics()
    grew = {k: after[k] - before.get(k, 0.0) for k in (
        "backplane_prompt_tokens_total", "backplane_generation_tokens_total",
        "backplane_time_to_first_token_seconds_count", "backplane_inter_token_latency_seconds_count",
        "backplane_e2e_request_latency_seconds_count")}
    assert list(grew.values()) == [3, 5, 1, 4, 1]
    assert after["backplane_kv_cache_total_tokens"] == 16384 and after["backplane_num_requests_waiting"] == 0



def test_metrics_show_prefix_cache_reuse(server):
    prompt = [(7 * k) % 400 + 3 for k in range(48)]
    body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    httpx.post(f"{server.url}/v1/completions", json=body)
    before = server.metrics()
    httpx.post(f"{server.url}/v1/completions", json=body)  # the same prompt: its prefix is cached
    after = server.metrics()
    assert after["backplane_prefix_cache_tokens"] >= len(prompt) - 1
    assert after["backplane_prefix_cache_hit_rate"] > before["backplane_prefix_cache_hit_rate"]
    assert after["backplane_kv_cache_used_tokens"] == 0  # cached, unreferenced slots are not in use

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_CHAT = [{"role": "user", "content": "hi"}]
# (id, endpoint, body (raw bytes or a JSON value), status, param, fragment of the error message)
HTTP_ROWS = [
    ("H01", C, b'{"prompt": "hi",', 400, None, "request body: expected JSON, got a parse error: Expecting"),
    ("H02", C, ["hi"], 400, None, "request body: expected a JSON object, got list"),
    ("H03", C, {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate",
     "frobnicate: unsupported field; this endpoint accepts: best_of, echo, frequency_penalty"),
    ("H04", C, {"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty",
     "presence_penalty: not supported by this engine; only 0.0 is accepted, got 0.5"),
    ("H05", C, {"prompt": "hi", "logprobs": 5}, 400, "logprobs", "logprobs: only 0 is supported"),
    ("H06", CHAT, {"messages": OK_CHAT, "logprobs": True, "top_logprobs": 3}, 400, "top_logprobs",
     "top_logprobs: not supported by this engine; only 0 is accepted, got 3"),
    ("H07", C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens",
     "max_tokens: Input should be greater than or equal to 1, got 0"),
    ("H08", C, {"prompt": "hi", "temperature": -1}, 400, "temperature",
     "temperature: Input should be greater than or equal to 0, got -1"),
    ("H09", C, {"prompt": "hi", "top_p": 0}, 400, "top_p", "top_p: expected in (0, 1], got 0"),
    ("H10", C, {"prompt": "hi", "stream": "yes"}, 400, "stream", "stream: Input should be a valid boolean, got 'yes'"),
    ("H11", C, {"max_tokens": 3}, 400, "prompt", "prompt: required field is missing"),
    ("H12", C, {"prompt": []}, 400, "prompt", "prompt: expected at least one prompt, got []"),
    ("H13", C, {"prompt": [[1, "a"]]}, 400, "prompt",
     "prompt: expected a string, a list of strings, a list of token ids or a list of lists of token ids"),
    ("H14", C, {"prompt": "hi", "max_tokens": 3000}, 400, "max_tokens",
     "prompt of 3 tokens + max_tokens 3000 exceeds the context length 2048"),
    ("H15", C, {"prompt": [1, 99999]}, 400, "prompt", "token id 99999 is outside the vocabulary; expected ids in [0, 512)"),
    ("H16", C, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream_options: only allowed when stream is true"),
    ("H17", C, {"prompt": "hi", "n": 0}, 400, "n", "n: Input should be greater than or equal to 1, got 0"),
    ("H18", C, {"prompt": "hi", "stop": [""]}, 400, "stop", "stop: expected non-empty strings, got ['']"),
    ("H19", C, {"prompt": "hi", "seed": -1}, 400, "seed", "seed: Input should be greater than or equal to 0, got -1"),
    ("H20", CHAT, {"messages": []}, 400, "messages", "messages: List should have at least 1 item"),
    ("H21", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role",
     "messages.0.role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool'"),
    ("H22", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.0.content.0", "messages.0.content.0: only text parts"),
    ("H23", C, {"prompt": "hi", "model": "nope"}, 404, "model", "model 'nope' does not exist; served: tiny-llama, shout"),
    ("H24", C, {"prompt": "x" * (MAX_BODY + 10)}, 413, None,
     f"bytes is over the limit of {MAX_BODY} bytes (--max-request-bytes)"),
    ("H25", "/v1/nothing", {}, 404, None, "POST /v1/nothing: Not Found"),
]


@pytest.mark.parametrize("row, path, body, status, param, fragment", HTTP_ROWS, ids=[r[0] for r in HTTP_ROWS])
def test_bad_request(row, path, body, status, param, fragment, server):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.url}{path}", content=raw, headers={"Content-Type": "application/json"}, timeout=30)
    error = r.json()["error"]
    assert r.status_code == status and error["code"] == status, r.text
    assert fragment in error["message"] and error["param"] == param, error
    assert "Traceback" not in r.text and error["type"] in ("invalid_request_error", "not_found_error")
    ok = httpx.post(f"{server.url}{C}", json={"prompt": [1, 2], "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and server.metrics()["backplane_kv_cache_used_tokens"] == 0


def test_table_lists_every_http_row():
    from test_server_limits import LIMIT_ROWS

    table = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()
    rows = [r[0] for r in HTTP_ROWS] + list(LIMIT_ROWS)
    assert rows == [f"H{i:02d}" for i in range(1, len(rows) + 1)]
    for row in rows:
        assert f"| {row} |" in table, row
