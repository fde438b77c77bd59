"""The engine process of `backplane serve`: an EngineLoop fed and drained over one Pipe.

`engine_main` is the target of a spawned process (process_engine.py starts it). It builds the
Engine from the pickled EngineArgs, answers `Ready` or `Failed` (messages.py), then:

- a receiver thread reads the server's messages as they come, so the server's sends never wait
  for a step: `AddRequests` is checked at once by `EngineLoop.accept` (the thread-mode checks,
  same messages) and answered by a `Verdict` before its requests are queued; `Abort`,
  `AbortAll` and `Stop` go to the loop;
- the main thread runs the loop; each step's news is ONE `Step` message, a `StepRow` per
  request, with EngineLoop.stats at most every STATS_INTERVAL_S and whenever the engine goes
  idle. Text is decoded by the server, so detokenization costs the engine nothing;
- at the end, `Stopped`, and the process exits.

Once built, everything alive (modules, the model's Python objects, plugins: some 300,000 objects)
goes to the permanent generation of the garbage collector (`freeze_startup_heap`), so that the
loop's full collections scan only what serving allocates: about 110 ms a full collection of
tiny-llama's engine on the dev CPU before, under a millisecond after.

The process ignores SIGINT and SIGTERM (a Ctrl-C reaches the whole process group): the server
drains and stops it. When the server process is gone the pipe reads EOF: the loop is stopped
and the process exits within EXIT_GRACE_S whatever it is doing; a watchdog on the parent pid
does the same while the model is still loading.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
from typing import Any

from backplane.engine.heap import freeze_startup_heap  # noqa: F401 - its name here is public too
from backplane.engine.engine_loop import EngineDeadError, EngineLoop, QueueFullError, RequestRejected
from backplane.engine.messages import (Abort, AbortAll, AddRequests, Failed, Ready, Step, StepRow, Stopped,
                                       Verdict)

STATS_INTERVAL_S = 0.01
EXIT_GRACE_S = 5.0
PARENT_POLL_S = 0.5
REFUSALS = (RequestRejected, QueueFullError, EngineDeadError)
ORPHANED = "the server process is gone"


def engine_main(conn: Any, args: Any, max_queued_requests: int | None, plugins: list[Any]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _watch_parent(os.getppid())
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    channel = _Channel(conn)
    try:
        engine = _build_engine(args, plugins)
    except BaseException as exc:  # noqa: BLE001 - every startup error goes back to the server as is
        channel.send(Failed(_portable(exc)))
        return
    sender = _StepSender(channel, engine.scheduler)
    loop = EngineLoop(engine, sender, max_queued_requests)
    sender.stats = loop.stats
    channel.send(_ready(engine, loop, freeze_startup_heap()))
    threading.Thread(target=_receive, args=(conn, loop, channel), name="backplane-engine-inbox", daemon=True).start()
    loop.run()
    loop.refuse_late_adds()
    channel.send(Stopped(loop.dead))
    engine.shutdown()


def _watch_parent(parent: int) -> None:
    """Exit once the server process is gone, even while the model still loads (nobody reads the
    pipe then); later the pipe's EOF stops the loop first and this is only the backstop."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        time.sleep(EXIT_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="backplane-engine-watchdog", daemon=True).start()


def _build_engine(args: Any, plugins: list[Any]) -> Any:
    from backplane.engine.engine import Engine
    from backplane.plugin.manager import load_plugins

    # NOTE: plugins load again here (a PluginSet does not pickle); `plugins` also reach TP workers.
    return Engine(server_args=args, plugin_set=load_plugins(strict=args.strict_plugins, extra=plugins),
                  plugins=plugins)


def _ready(engine: Any, loop: EngineLoop, gc_frozen: int = 0) -> Ready:
    """What the server needs to load the same tokenizer and answer /v1/models and /metrics."""
    runner = engine.runner
    return Ready(os.getpid(), runner.context_len,
                 (runner.source.path, int(runner.hf_config.vocab_size), engine.args.tokenizer_path), loop.stats(),
                 gc_frozen)


def _portable(exc: BaseException) -> BaseException:
    """The exception itself when it survives pickling, else a RuntimeError with its message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - an exception class that pickle cannot rebuild
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class _Channel:
    """The pipe's sending end, shared by the loop and the receiver thread."""

    def __init__(self, conn: Any):
        self.conn = conn
        self.lock = threading.Lock()
        self.broken = False

    def send(self, message: Any) -> None:
        if self.broken:
            return
        try:
            with self.lock:
                self.conn.send(message)
        except OSError:  # the server is gone; the receiver thread stops the loop
            self.broken = True


class _StepSender:
    """EngineLoop's publish: one Step message per call that has news or stats due."""

    def __init__(self, channel: _Channel, scheduler: Any):
        self.channel, self.scheduler = channel, scheduler
        self.stats: Any = None  # EngineLoop.stats, set once the loop exists
        self.last_stats = 0.0

    def __call__(self, items: list) -> None:
        now = time.perf_counter()
        stats = None
        if now - self.last_stats >= STATS_INTERVAL_S or not self.scheduler.has_work:
            stats, self.last_stats = self.stats(), now
        if not items and stats is None:
            return
        rows = [StepRow(key, d.token_ids, d.logprobs, d.finish_reason, d.error, d.final_text, d.num_output_tokens)
                for key, d in items]
        self.channel.send(Step(items[0][1].time if items else now, rows, stats))


def _receive(conn: Any, loop: EngineLoop, channel: _Channel) -> None:
    """The receiver thread: apply the server's messages until "stop" or EOF."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if isinstance(message, AddRequests):
            _admit(loop, channel, message)
        elif isinstance(message, Abort):
            loop.abort(message.key, message.message)
        elif isinstance(message, AbortAll):
            loop.abort_all(message.message)
        else:  # Stop
            loop.stop(message.message)
            return
    loop.stop(ORPHANED)
    timer = threading.Timer(EXIT_GRACE_S, os._exit, [1])  # a step that never ends must not keep us
    timer.daemon = True
    timer.start()


def _admit(loop: EngineLoop, channel: _Channel, message: AddRequests) -> None:
    try:
        reqs = loop.accept(message.token_lists, message.params, message.lora)
    except REFUSALS as err:
        channel.send(Verdict(message.batch, type(err).__name__, str(err)))
        return
    except Exception as err:  # noqa: BLE001 - a malformed request must not kill the receiver
        channel.send(Verdict(message.batch, "RuntimeError", f"{type(err).__name__}: {err}"))
        return
    channel.send(Verdict(message.batch))  # NOTE: before any step can carry these keys
    for key, req in zip(message.keys, reqs):
        loop.add(key, req, key)
