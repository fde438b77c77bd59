"""ProcessEngine: AsyncEngine's interface over an engine in a process of its own (`backplane serve`).

In one process the event loop's per-token Python (HTTP, SSE, JSON, detokenization) and the
scheduler take turns at one GIL, so the server's throughput is at most the engine's share of it.
Here the scheduler runs in a spawned child (engine_process.py, built from the same pickled
EngineArgs; an Engine object cannot move between processes) and the two exchange messages over
one Pipe: requests and aborts one way, one message per engine step the other way.

This side keeps the streams (RequestStream, so detokenization happens here), loads the same
tokenizer for prompts and chat templates, and reads the child's messages on a reader thread that
hands each event loop one callback per step. The constructor returns once the engine is ready
and raises the child's startup error as is. If the child dies, `dead` says so, every request in
flight ends with that error and new ones raise EngineDeadError.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import threading
import time
from typing import Any, Sequence

from backplane.engine.engine_loop import EngineDeadError, QueueFullError, RequestRejected
from backplane.engine.engine_process import engine_main
from backplane.engine.messages import Abort, AbortAll, AddRequests, Failed, Ready, Step, Stop, Verdict
from backplane.scheduler.sampling_params import SamplingParams
from backplane.text.stream import Delta, RequestStream, deliver_by_loop, stop_holdback
from backplane.text.tokenizer import decode_text, load_tokenizer

logger = logging.getLogger(__name__)

ERRORS = {cls.__name__: cls for cls in (RequestRejected, QueueFullError, EngineDeadError, RuntimeError)}
STOP_TIMEOUT_S = 30.0


class ProcessEngine:
    """The engine of `server_args` in a spawned process, driven like AsyncEngine.

    max_queued_requests: as AsyncEngine's (checked in the engine process, with its messages).
    plugins: plugin objects registered there besides the installed ones (they must pickle).
    The child is spawned, so a script that builds one needs the `if __name__ == "__main__":`
    guard that multiprocessing asks for (`backplane serve` has it).
    """

    def __init__(self, server_args: Any, max_queued_requests: int | None = None, plugins: Sequence[Any] = ()):
        context = multiprocessing.get_context("spawn")
        self.args = server_args
        self._conn, child_conn = context.Pipe()
        # NOTE: not daemonic: a daemonic process may not start tensor-parallel workers.
        self.process = context.Process(target=engine_main, args=(child_conn, server_args, max_queued_requests, list(plugins)),
                                       name="backplane-engine")
        self.process.start()
        child_conn.close()  # only the child holds its end: its exit reads as EOF here
        atexit.register(self._kill)
        try:
            ready = self._wait_ready()
            self.tokenizer = load_tokenizer(*ready.tokenizer)  # the engine process loaded it too
        except BaseException:  # a startup error, or Ctrl-C while the model loads
            self._kill()
            raise
        self.pid: int = ready.pid
        self.gc_frozen: int = ready.gc_frozen  # objects the engine process froze after startup
        self.context_len: int = ready.context_len
        self._stats: dict[str, Any] = ready.stats
        self.dead: str | None = None
        self._streams: dict[int, RequestStream] = {}  # by key, until the stream's last delta
        self._verdicts: dict[int, tuple[Any, asyncio.Future]] = {}  # by batch: (loop, future)
        self._lock = threading.Lock()  # the two dicts
        # NOTE: reentrant: a stream dropped unfinished aborts from its finaliser, which may run
        # in this very thread in the middle of a send (pickling allocates; the send is then whole).
        self._send_lock = threading.RLock()
        self._keys, self._batches = itertools.count(), itertools.count()
        self._reader = threading.Thread(target=self._read, name="backplane-engine-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> Ready:
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise EngineDeadError(f"the engine process exited with code {self.process.exitcode} "
                                  "while starting") from None
        if isinstance(message, Failed):
            raise message.error
        return message

    # -- the interface the server uses (AsyncEngine's) ------------------------------------------

    @property
    def num_running(self) -> int:
        return self._stats["num_running"]

    @property
    def num_waiting(self) -> int:
        return self._stats["num_waiting"]

    @property
    def kv_usage(self) -> tuple[int, int]:
        return self._stats["kv_usage"]

    @property
    def prefix_cache_stats(self) -> dict[str, Any]:
        return self._stats["prefix_cache"]

    def decode(self, ids: list[int]) -> str:
        return decode_text(self.tokenizer, ids)

    async def start_requests(self, token_lists: list[list[int]], params: list[SamplingParams],
                             lora: str | None = None) -> list[RequestStream]:
        """Submit requests (all or none); returns once the engine process has accepted them.

        Raises RequestRejected, QueueFullError or EngineDeadError, with the thread mode's messages.
        """
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        loop = asyncio.get_running_loop()
        now, keys, batch = time.perf_counter(), [next(self._keys) for _ in token_lists], next(self._batches)
        streams = [RequestStream(key, len(ids), now, loop, self.decode, stop_holdback(p), self._close_stream)
                   for key, ids, p in zip(keys, token_lists, params)]
        verdict = loop.create_future()
        with self._lock:
            self._streams.update(zip(keys, streams))
            self._verdicts[batch] = (loop, verdict)
        try:
            self._send(AddRequests(batch, keys, token_lists, params, lora))
            kind, message = await verdict
        except BaseException:  # cancelled (the client left) or the engine is gone
            for stream in streams:
                stream.close()
            raise
        if kind is not None:
            self._forget(keys)
            raise ERRORS.get(kind, RuntimeError)(message)
        return streams

    def abort(self, rid: int, message: str = "aborted by the client") -> None:
        """Abort a request: the engine process frees its KV before its next step; its stream ends."""
        self._send(Abort(rid, message))

    def abort_all(self, message: str) -> None:
        """Abort every request in flight (any thread); nothing to do once the engine is gone."""
        try:
            self._send(AbortAll(message))
        except EngineDeadError:
            pass

    def shutdown(self, message: str = "the server is shutting down", timeout: float = STOP_TIMEOUT_S) -> None:
        """Abort every request in flight, stop the engine process and wait for it; idempotent."""
        if self.process.is_alive():
            try:
                self._send(Stop(message))
            except EngineDeadError:
                pass
            self.process.join(timeout)
        self._kill()
        self._reader.join(5)

    # -- internals ------------------------------------------------------------------------------

    def _send(self, message: Any) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except OSError:  # the engine process is gone (the reader has seen, or will see, EOF)
            raise EngineDeadError(self.dead or "the engine process has stopped") from None

    def _close_stream(self, stream: RequestStream) -> None:
        try:
            self.abort(stream.rid)
        except EngineDeadError as err:  # nobody left to publish the end: end the stream here
            self._forget([stream.rid])
            stream.put(Delta([], [], "abort", str(err), None, len(stream.token_ids)))

    def _forget(self, keys: list[int]) -> None:
        with self._lock:
            for key in keys:
                self._streams.pop(key, None)

    def _kill(self) -> None:
        """SIGKILL the engine process if it still runs (it ignores SIGTERM: the pipe drives it)."""
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def _read(self) -> None:
        """The reader thread: route the engine process's messages until it closes the pipe."""
        stopped = None
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, Step):
                self._on_step(message)
            elif isinstance(message, Verdict):
                self._on_verdict(message)
            else:  # Stopped
                stopped = message.reason
        self._on_exit(stopped)

    def _on_step(self, step: Step) -> None:
        if step.stats is not None:
            self._stats = step.stats
        items, now = [], step.time
        with self._lock:
            streams = self._streams
            for key, ids, logprobs, finish_reason, error, final_text, num_output_tokens in step.rows:
                stream = streams.pop(key, None) if finish_reason else streams.get(key)
                if stream is not None:
                    items.append((stream, Delta(ids, logprobs, finish_reason, error, final_text,
                                                num_output_tokens, now)))
        if items:
            deliver_by_loop(items)

    def _on_verdict(self, verdict: Verdict) -> None:
        with self._lock:
            loop, future = self._verdicts.pop(verdict.batch)
        _resolve_soon(loop, future, (verdict.kind, verdict.message))

    def _on_exit(self, stopped: str | None) -> None:
        """The pipe is closed: the engine process stopped or died; end everything still open."""
        if stopped is None:
            self.process.join(5)
            stopped = f"the engine process exited unexpectedly (exit code {self.process.exitcode})"
            logger.error("%s; every request in flight fails", stopped)
        self.dead = stopped
        with self._lock:
            streams, self._streams = self._streams, {}
            verdicts, self._verdicts = self._verdicts, {}
        for loop, verdict in verdicts.values():
            _resolve_soon(loop, verdict, ("EngineDeadError", stopped))
        deliver_by_loop([(s, Delta([], [], "abort", stopped, None, len(s.token_ids))) for s in streams.values()])


def _resolve_soon(loop: Any, future: asyncio.Future, value: Any) -> None:
    def resolve() -> None:
        if not future.done():  # a cancelled submitter no longer waits
            future.set_result(value)

    try:
        loop.call_soon_threadsafe(resolve)
    except RuntimeError:  # that loop is closed
        pass
