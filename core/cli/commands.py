"""The `generate` and `bench` subcommands."""

from __future__ import annotations

import argparse
import json
import sys
import time
from types import SimpleNamespace

DEFAULT_PROMPTS = ["The capital of France is", "Plugins make an executor"]


def _add_generate_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--input-ids", action="append", type=_ids, help="comma-separated token ids (repeatable)")
    g.add_argument("--max-new-tokens", type=int, default=32,
                   help="new tokens per prompt (default: 32; SamplingParams in Python defaults to 128, "
                        "the HTTP completions API to 16)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating after end-of-sequence")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the smallest set of tokens whose probability adds up to P "
                        "(default: 1.0, off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (default: 0, off)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than P times the most likely one (default: 0.0, off)")
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    g.add_argument("--lora", default=None, help="adapter name (from --lora-paths) for every prompt")
    g.add_argument("--json", action="store_true", help="print one JSON document")


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,2,3, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"expected token ids >= 0, got {text!r}")
    return ids


def _run_generate(ns: argparse.Namespace, args, plugin_set) -> int:
    from backplane.engine import Engine

    if ns.prompt and ns.input_ids:
        raise ValueError("--prompt and --input-ids: pass one or the other, not both")
    params = _sampling_params(ns, args.seed)
    engine = Engine(server_args=args, plugin_set=plugin_set)
    try:
        return _generate_and_print(ns, engine, params)
    finally:  # also on Ctrl-C: tensor-parallel workers stop with the command
        engine.shutdown()


def _generate_and_print(ns: argparse.Namespace, engine, params) -> int:
    inputs = {"input_ids": ns.input_ids} if ns.input_ids else {"prompts": ns.prompt or DEFAULT_PROMPTS}
    start = time.perf_counter()
    outputs = engine.generate(sampling_params=params, lora=ns.lora, progress=_progress(ns, params), **inputs)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.token_ids) for o in outputs)
    if ns.json:
        print(json.dumps({"outputs": [o.to_dict() for o in outputs], "backends": engine.backends, "threads": engine.threads,
                          "stats": engine.stats(), "elapsed_s": elapsed, "tokens_per_s": num_tokens / elapsed}, allow_nan=False))
    else:
        _print_text(outputs, engine, num_tokens, elapsed)
    return 2 if any(o.error for o in outputs) else 0


def _sampling_params(ns: argparse.Namespace, seed: int):
    """The flags' SamplingParams; a bad value is a one-line error naming its flag."""
    from backplane.engine import SamplingParams

    try:
        return SamplingParams(max_new_tokens=ns.max_new_tokens, temperature=ns.temperature, top_p=ns.top_p,
                              top_k=ns.top_k, min_p=ns.min_p, ignore_eos=ns.ignore_eos, stop=ns.stop,
                              seed=seed if ns.temperature > 0 else None)
    except ValueError as err:  # "SamplingParams.top_p: expected ..., got ..."
        field = str(err).removeprefix("SamplingParams.").partition(":")[0]
        raise ValueError(f"--{field.replace('_', '-')}: {err}") from None


def _progress(ns, params):
    if ns.json or params.max_new_tokens < 64 or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    bar = tqdm(desc="requests", unit="req")
    return lambda finished: bar.update(len(finished))


def _print_text(outputs, engine, num_tokens: int, elapsed: float) -> None:
    for i, out in enumerate(outputs):
        prompt = engine.decode(out.prompt_token_ids) if engine.tokenizer else out.prompt_token_ids
        print(f"[{i}] prompt: {prompt!r}")
        if out.error:
            print(f"    error: {out.error}")
            continue
        print(f"    output: {out.text!r} ({len(out.token_ids)} tokens, finish: {out.finish_reason})")
    attn = engine.backends["attention"]
    print(f"model {engine.args.model} on {engine.backends['device']} ({engine.backends['dtype']}); "
          f"attention prefill={attn['prefill']['backend']} (plugin {attn['prefill']['plugin']}), "
          f"decode={attn['decode']['backend']} (plugin {attn['decode']['plugin']}); "
          f"custom ops: {_ops_summary(engine.backends['custom_ops'])}")
    print(f"{num_tokens} tokens in {elapsed:.2f} s: {num_tokens / elapsed:.1f} tokens/s; "
          f"{_cache_summary(engine.stats()['prefix_cache'])}" + (f"; {engine.threads}" if engine.threads else ""))
    accepted = [o.speculative for o in outputs if o.speculative]
    if accepted:
        tokens, steps = sum(a["tokens"] for a in accepted), sum(a["steps"] for a in accepted)
        print(f"speculative decoding ({engine.args.speculative_algorithm}): {tokens} tokens in {steps} verify "
              f"steps, mean acceptance length {tokens / max(steps, 1):.2f}")


def _cache_summary(cache: dict) -> str:
    if not cache["enabled"]:
        return f"prefix cache off ({cache.get('disabled_reason', 'disabled')})"
    return (f"prefix cache hit {cache['hit_tokens']}/{cache['query_tokens']} prompt tokens "
            f"({100 * cache['hit_rate']:.1f}%)")


def _ops_summary(chosen: dict[str, str]) -> str:
    by_impl: dict[str, list[str]] = {}
    for op, impl in chosen.items():
        by_impl.setdefault(impl, []).append(op)
    return "; ".join(f"{impl}: {', '.join(ops)}" for impl, ops in by_impl.items())


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    from backplane.cli.bench import add_bench_arguments

    add_bench_arguments(p)


def _run_bench(ns, args, plugin_set) -> int:
    from backplane.cli.bench import run_bench

    return run_bench(ns, args, plugin_set)


generate_command = SimpleNamespace(add_arguments=_add_generate_arguments, run=_run_generate)
bench_command = SimpleNamespace(add_arguments=_bench_arguments, run=_run_bench)
