"""Engine: the offline entry point. `Engine(model=..., **server_args).generate(prompts, params)`."""

from __future__ import annotations

import gc
import itertools
import logging
import os
import threading
from typing import Any, Sequence

from backplane.config import apply_cpu_threads, resolve_prefix_cache, resolve_runtime
from backplane.distributed.launcher import WorkerFailedError
from backplane.engine.inputs import PromptInput, split_prompts
from backplane.scheduler.prefix_cache import PrefixCache
from backplane.scheduler.request import FinishReason, Req, RequestOutput
from backplane.scheduler.sampling_params import SamplingParams
from backplane.scheduler.scheduler import Scheduler
from backplane.text.tokenizer import decode_text, eos_ids, load_tokenizer
from backplane.plugin.manager import PluginSet, load_plugins
from backplane.runtime import build_runtime
from backplane.settings import EngineArgs, build_server_args
from backplane.speculative.factory import check_spec_settings, sampling_refusal

logger = logging.getLogger(__name__)


class Engine:
    """Loads plugins, builds the model runner from EngineArgs, and serves generate calls.

    Engine(model="tiny-llama", attention_backend="auto", max_total_tokens=4096, ...): keyword
    arguments are EngineArgs fields; `plugin_options={"group": {...}}` sets plugin option groups;
    `plugins=[obj, ...]` registers plugin objects without packaging them.
    """

    def __init__(self, model: str | None = None, *, plugins: Sequence[Any] = (),
                 plugin_options: dict[str, dict[str, Any]] | None = None,
                 server_args: EngineArgs | None = None, plugin_set: PluginSet | None = None, **kwargs: Any):
        from backplane.distributed.driver import start_tensor_parallel, tp_startup
        from backplane.executor.model_runner import resolve_device

        if model is not None:
            kwargs["model"] = model
        self.plugin_set = plugin_set or load_plugins(strict=kwargs.get("strict_plugins"), extra=plugins)
        self.args = server_args or build_server_args(kwargs, self.plugin_set.settings_groups(), plugin_options)
        self.plugin_set.configure(self.args)
        self.spec = check_spec_settings(self.args, self.plugin_set)  # fail fast, before the model
        self.config = resolve_runtime(self.args, resolve_device(self.args))
        self.threads = self._check_model_and_threads()  # before any worker starts
        # --tp-size N: this process is rank 0 and spawns ranks 1..N-1 (None at tp size 1).
        self.tp = start_tensor_parallel(self.args, plugins, self.config.tensor_parallel)
        with tp_startup(self.tp):  # a failure here stops the workers and names one that caused it
            runtime = build_runtime(self.args, self.plugin_set, self.tp.parallel if self.tp else None,
                                    router=self.tp, ready=self.tp.wait_ready if self.tp else None,
                                    pool=self.config.pool, source=self.source)
        self.runner, self.lora_manager, self.spec_worker = runtime.runner, runtime.lora, runtime.spec_worker
        self.tokenizer = load_tokenizer(self.runner.source.path, int(self.runner.hf_config.vocab_size),
                                        self.args.tokenizer_path)
        refusal = getattr(self.spec_worker, "prefix_cache_refusal", None)
        self.scheduler = Scheduler(
            self.runner, self.config.scheduler, eos_token_ids=eos_ids(self.tokenizer, self.runner.hf_config),
            detokenize=self.decode, participants=runtime.participants, spec_worker=self.spec_worker,
            prefix_cache=PrefixCache.from_config(self.runner, resolve_prefix_cache(self.args, refusal)),
        )
        if self.spec_worker is not None and not self.args.disable_overlap_schedule:
            logger.info("overlap scheduling is off under speculative decoding (%s): each step's tokens "
                        "are read before the next is built", self.spec.name)
        if self.lora_manager:
            self.lora_manager.bind_running(self.scheduler)  # the running requests' adapters stay loaded
        self._rids = itertools.count()
        self._lock = threading.Lock()  # one generate call at a time: the scheduler is not thread-safe
        self.pid = os.getpid()
        self.driver: str | None = None  # what else runs the scheduler (an AsyncEngine's thread), if anything
        self._dead: str | None = None
        self.gc_frozen = 0  # objects moved to the garbage collector's permanent generation (--gc-freeze)
        if self.args.gc_freeze:
            from backplane.engine.heap import freeze_startup_heap

            self.gc_frozen = freeze_startup_heap()

    def _check_model_and_threads(self) -> str | None:
        """Refuse a --tp-size the model's heads do not divide, in one line, before any worker starts;
        on CPU set torch's threads for this model (backplane.config.apply_cpu_threads) and say so."""
        from backplane.executor.model_runner import resolve_model_source
        from backplane.models.config_check import check_tensor_parallel

        self.source = resolve_model_source(self.args)
        hf_config = self.source.hf_config
        check_tensor_parallel(hf_config, self.args.tp_size)
        if self.config.device != "cpu":
            return None
        line = apply_cpu_threads(self.args, hf_config)
        logger.info("%s", line)
        return line

    # -- EngineClient (backplane.engine.client) ------------------------------------------------

    @property
    def context_len(self) -> int:
        return self.runner.context_len

    @property
    def dead(self) -> str | None:
        """Why the engine is unusable (shut down), or None."""
        return self._dead

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> tuple[int, int]:
        """(KV slots requests hold, slots in the pool); unreferenced prefix-cache entries count as free."""
        return self.scheduler.kv_usage

    @property
    def prefix_cache_stats(self) -> dict[str, Any]:
        return self.scheduler.prefix_cache.stats()

    def take_over(self, driver: str) -> None:
        """Let `driver` (an AsyncEngine's thread) run the scheduler; `generate` is refused meanwhile."""
        with self._lock:
            if self.driver is not None:
                raise RuntimeError(f"{driver}: this Engine is already driven by {self.driver}; "
                                   "build another Engine, or shut that one down first")
            self.driver = driver

    def hand_back(self) -> None:
        """The driver has stopped: `generate` may run the scheduler again."""
        self.driver = None

    def stats(self) -> dict[str, Any]:
        """Serving counters; "prefix_cache": hit and query token counts, the hit rate, and the
        tokens prefill computed (prefill_tokens)."""
        return {"prefix_cache": self.scheduler.prefix_cache.stats()}

    def flush_cache(self) -> None:
        """Empty the prefix cache and put the free KV slots back in order, as on a fresh engine
        (benchmarks time a workload from the same start). Only between generate calls."""
        with self._lock:
            if self.scheduler.running or self.scheduler.waiting:
                raise RuntimeError(f"flush_cache: expected no request in flight, got {len(self.scheduler.running)} "
                                   f"running and {len(self.scheduler.waiting)} waiting")
            self.scheduler.prefix_cache.clear()
            self.runner.token_to_kv_pool.sort_free()

    @property
    def overlap_schedule(self) -> bool:
        """Whether steps overlap (on by default; off with --disable-overlap-schedule or speculation)."""
        return self.scheduler.overlap

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at exit); the engine is unusable after."""
        self._dead = "the engine was shut down"
        if getattr(self, "gc_frozen", 0):  # --gc-freeze: its objects (and all frozen since) collectable again
            self.gc_frozen = 0
            gc.unfreeze()
        tp = getattr(self, "tp", None)
        if tp is not None:
            tp.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def decode(self, ids: list[int]) -> str:
        return decode_text(self.tokenizer, ids)

    @property
    def backends(self) -> dict[str, Any]:
        summary = self.runner.backends_summary()
        summary["overlap_schedule"] = self.overlap_schedule
        if self.lora_manager:
            summary["lora"] = self.lora_manager.summary()
        if self.spec_worker is not None:
            stats = self.spec_worker.stats
            summary["speculative"] = {"algorithm": self.spec.name, "num_draft_tokens": self.spec_worker.num_draft_tokens,
                                      "mean_acceptance_length": stats.mean_acceptance_length}
        return summary

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 input_ids: Sequence[Sequence[int]] | Sequence[int] | None = None,
                 lora: str | Sequence[str | None] | None = None, progress=None) -> list[RequestOutput]:
        """Run every request to completion with continuous batching; one output per request, in order.

        A request that cannot run (empty, too long, unknown adapter) comes back with
        finish_reason "abort" and `error`; the others are served normally.
        """
        with self._lock:  # concurrent callers are served one call after another
            if self.driver is not None:
                raise RuntimeError(f"Engine.generate: this engine is driven by {self.driver}, whose thread runs "
                                   "its scheduler; submit there (add_request), or shut it down first")
            reqs = self._make_requests(prompts, input_ids, sampling_params, lora)
            try:
                for req in reqs:
                    if not req.finished:
                        self.scheduler.add(req)
                while self.scheduler.has_work:
                    finished = self._step()
                    if progress is not None:
                        progress(finished)
            except BaseException as exc:  # KeyboardInterrupt, a raising callback: free this call's slots first
                for req in reqs:
                    if not req.finished:
                        self.scheduler.abort(req, f"generate interrupted: {type(exc).__name__}")
                raise
            return [self._output(req) for req in reqs]

    def _step(self) -> list[Req]:
        try:
            return self.scheduler.step()
        except WorkerFailedError:
            raise  # a tensor-parallel rank is gone: the engine cannot go on (its workers are stopped)
        except Exception as exc:  # noqa: BLE001 - a failing forward must not lose the pool
            logger.exception("forward failed; rolling back its batch (a lone request is aborted)")
            return self.scheduler.fail_batch(f"forward pass failed: {type(exc).__name__}: {exc}")

    def _make_requests(self, prompts, input_ids, sampling_params, lora) -> list[Req]:
        """One Req per request; one that cannot run (malformed prompt, bad sampling parameters,
        unknown adapter) is already aborted with its error, before anything is scheduled."""
        inputs = split_prompts(prompts, input_ids)
        params = _broadcast(sampling_params or SamplingParams(), len(inputs), "sampling_params")
        adapters = _broadcast(lora, len(inputs), "lora")
        reqs = []
        for item, p, adapter in zip(inputs, params, adapters):
            req = Req(next(self._rids), [], p, adapter)
            error = self._prompt_error(req, item) or _params_error(p) or self._adapter_error(req)
            if error:
                req.abort(f"request {req.rid}: {error}")
            elif (refusal := sampling_refusal(self.spec, req)) is not None:
                req.abort(refusal)
            reqs.append(req)
        return reqs

    def _prompt_error(self, req: Req, item: PromptInput) -> str | None:
        """Fill req.prompt_ids from the prompt (tokenizing text); the reason it cannot, or None."""
        if item.error:
            return item.error
        if item.ids is not None:
            req.prompt_ids = item.ids
            return None
        if self.tokenizer is None:
            return f"prompt: --model {self.args.model} has no tokenizer; pass input_ids instead of text"
        req.prompt_ids = [int(t) for t in self.tokenizer.encode(item.text)]
        return None

    def _adapter_error(self, req: Req) -> str | None:
        if req.lora is None:
            return None
        known = self.args.lora_path_map
        if isinstance(req.lora, str) and req.lora in known:
            return None
        return (f"unknown LoRA adapter {req.lora!r}; "
                f"loaded: {', '.join(sorted(known)) or 'none (pass --lora-paths name=path)'}")

    def _output(self, req: Req) -> RequestOutput:
        text = req.text if req.text is not None else self.decode(req.output_ids)
        return RequestOutput(
            token_ids=list(req.output_ids), text=text,
            finish_reason=(req.finish_reason or FinishReason.ABORT).value, logprobs=list(req.logprobs),
            prompt_token_ids=req.prompt_ids, error=req.error, speculative=self._acceptance(req), **_timings(req),
        )

    def _acceptance(self, req: Req) -> dict[str, float] | None:
        accepted = self.spec_worker.acceptance(req) if self.spec_worker is not None else None
        return accepted.to_dict() if accepted is not None else None


def _timings(req: Req) -> dict[str, float | None]:
    if req.first_token_at is None:
        return {}
    ttft = req.first_token_at - req.created_at
    n = len(req.output_ids)
    tpot = (req.finished_at - req.first_token_at) / (n - 1) if req.finished_at is not None and n > 1 else None
    return {"ttft_s": ttft, "tpot_s": tpot}


def _params_error(params: Any) -> str | None:
    if not isinstance(params, SamplingParams):
        return f"sampling_params: expected a SamplingParams, got {type(params).__name__}"
    return params.problem()  # fields changed after construction are caught here


def _broadcast(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"generate: {name} has {len(value)} entries for {n} requests; expected one or {n}")
        return list(value)
    return [value] * n
