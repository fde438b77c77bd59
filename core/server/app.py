"""The FastAPI app: OpenAI routes, /v1/models, /health, /metrics, auth, limits and error JSON.

Every error leaves as OpenAI-style JSON (see errors.py) with no traceback, and is logged in one line
(4xx and 503 at warning level). /v1/* needs `Authorization: Bearer <key>` when an API key is set (a
401 carries `WWW-Authenticate: Bearer`); /health and /metrics never do. Import this
module only after `check_serve_dependencies()` (it imports FastAPI).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from backplane.server.chat import ChatTemplate
from backplane.server.errors import ApiError, bad_request, error_body
from backplane.server.generation import SHUTDOWN_MESSAGE, collect, event_stream, submit
from backplane.server.metrics import ServerMetrics
from backplane.server.openai_format import ChatFormatter, CompletionFormatter
from backplane.server.protocol import ChatRequest, CompletionRequest, chat_messages, parse, sampling_params
from backplane.server.settings import ServeArgs
from backplane.engine.client import StreamingEngineClient

logger = logging.getLogger(__name__)
# One line per request (status and time to the response's headers); launch.py turns it on (--access-log).
access_logger = logging.getLogger("backplane.server.access")

ENGINE_STOP_S = 0.1  # how long a stopped engine process may take to exit before it is killed
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class ServerState:
    """What the routes share: the engine, served names, chat template, metrics, the draining flag."""

    def __init__(self, engine: StreamingEngineClient, serve_args: ServeArgs):
        self.engine = engine
        self.args = serve_args
        self.model_name = serve_args.served_model_name or engine.args.model
        self.adapters = dict(sorted(engine.args.lora_path_map.items()))
        self.chat = ChatTemplate(engine.tokenizer, self.model_name, serve_args.chat_template)
        self.metrics = ServerMetrics(engine)
        self.context_len = engine.context_len
        self.created = int(time.time())
        self.draining = False  # set on SIGTERM: new generation requests get 503

    def authorize(self, request: Any) -> None:
        key = self.args.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' "
                                "(the key set by --api-key or BACKPLANE_API_KEY)", headers={"WWW-Authenticate": "Bearer"})

    def accept(self, request: Any) -> None:
        self.authorize(request)
        if self.draining:
            raise ApiError(503, SHUTDOWN_MESSAGE, headers={"Retry-After": "1"})

    async def read_json(self, request: Any) -> Any:
        limit = self.args.max_request_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise _too_large(int(length), limit)
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise _too_large(len(body), limit)
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise bad_request(f"request body: expected JSON, got a parse error: {err}") from None
        except RecursionError:  # a body nested deeper than Python's parser goes
            raise bad_request("request body: expected JSON nested at most a few hundred levels deep, "
                              "got one nested deeper") from None

    def adapter_for(self, model: str | None) -> str | None:
        """None for the base model, else the LoRA adapter named by the request's `model`."""
        if model is None or model == self.model_name:
            return None
        if model in self.adapters:
            return model
        served = ", ".join([self.model_name, *self.adapters])
        raise ApiError(404, f"model {model!r} does not exist; served: {served}", "model")

    def prompt_ids(self, prompt: Any) -> list[list[int]]:
        prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        if not prompts:
            raise bad_request("prompt: expected at least one prompt, got []", "prompt")
        if any(isinstance(p, str) for p in prompts) and self.engine.tokenizer is None:
            raise bad_request(f"prompt: model {self.model_name!r} has no tokenizer; send token ids", "prompt")
        return [list(self.engine.tokenizer.encode(p)) if isinstance(p, str) else list(p) for p in prompts]

    def decode_token(self, token_id: int) -> str:
        return self.engine.decode([token_id])

    def models(self) -> dict[str, Any]:
        base = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "backplane",
                "root": self.engine.args.model, "parent": None, "max_model_len": self.context_len}
        adapters = [{**base, "id": name, "root": path, "parent": self.model_name}
                    for name, path in self.adapters.items()]
        return {"object": "list", "data": [base, *adapters]}


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"request body of {size} bytes is over the limit of {limit} bytes (--max-request-bytes)")


async def _respond(state: ServerState, request: Any, body: Any, prompts: list[list[int]], max_tokens: int,
                   formatter: Any) -> Any:
    lora = state.adapter_for(body.model)
    params = [sampling_params(body, max_tokens) for _ in prompts]
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    gen = await submit(state.engine, state.metrics, prompts, params, lora, formatter, body.n, include_usage,
                 body.return_token_ids)
    if body.stream:
        return StreamingResponse(event_stream(request, gen), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return JSONResponse(await collect(request, gen))


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Any:
        if state.engine.dead or state.draining:
            return JSONResponse(error_body(503, state.engine.dead or "shutting down"), status_code=503)
        return {"status": "ok", "engine_pid": state.engine.pid}  # the pid tells the two modes apart

    @app.get("/metrics")
    async def metrics() -> Any:
        content, media_type = state.metrics.render()
        return Response(content, media_type=media_type)

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        state.authorize(request)
        return state.models()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        state.accept(request)
        body = parse(CompletionRequest, await state.read_json(request))
        formatter = CompletionFormatter(body.model or state.model_name, state.decode_token,
                                        body.logprobs is not None, body.return_token_ids)
        return await _respond(state, request, body, state.prompt_ids(body.prompt),
                              body.max_tokens or DEFAULT_COMPLETION_TOKENS, formatter)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        state.accept(request)
        body = parse(ChatRequest, await state.read_json(request))
        prompt = state.chat.render(chat_messages(body))
        # Without a limit a chat reply may fill the context (vLLM does the same).
        max_tokens = body.max_completion_tokens or body.max_tokens or max(state.context_len - len(prompt), 1)
        formatter = ChatFormatter(body.model or state.model_name, state.decode_token, body.logprobs,
                                  body.return_token_ids)
        return await _respond(state, request, body, [prompt], max_tokens, formatter)


def stop_engine(engine: StreamingEngineClient) -> None:
    """Stop the engine; an engine process (its requests already finished or aborted) gets
    ENGINE_STOP_S to exit before it is killed, so the server's exit stays bounded."""
    if engine.pid != os.getpid():
        engine.shutdown(timeout=ENGINE_STOP_S)
    else:  # NOTE: an engine thread is never cut off mid-step: it frees what the process still uses
        engine.shutdown()


def build_app(engine: StreamingEngineClient, serve_args: ServeArgs | None = None) -> FastAPI:
    """The ASGI app over a running AsyncEngine or ProcessEngine (any StreamingEngineClient);
    `app.state.server` is its ServerState."""
    if not isinstance(engine, StreamingEngineClient):
        raise TypeError(f"build_app: expected a StreamingEngineClient (an AsyncEngine or ProcessEngine; "
                        f"backplane.engine.client), got {type(engine).__name__}")
    state = ServerState(engine, serve_args or ServeArgs())

    @contextlib.asynccontextmanager
    async def lifespan(app: Any):
        yield
        stop_engine(engine)  # after uvicorn has drained (or cancelled) every connection

    app = FastAPI(title="backplane", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    @app.exception_handler(ApiError)
    async def api_error(request: Any, err: ApiError) -> Any:
        state.metrics.rejected.labels(str(err.status)).inc()
        logger.warning("%s %s -> %d: %s", request.method, request.url.path, err.status, err.message)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Any, err: HTTPException) -> Any:  # unknown route, wrong method
        message = f"{request.method} {request.url.path}: {err.detail}"
        logger.warning("%s %s -> %d: %s", request.method, request.url.path, err.status_code, err.detail)
        return JSONResponse(error_body(err.status_code, message), status_code=err.status_code)

    @app.middleware("http")
    async def access_log(request: Any, call_next: Any) -> Any:
        start = time.perf_counter()
        response = await call_next(request)
        client = f"{request.client.host}:{request.client.port}" if request.client else "-"
        access_logger.info('%s "%s %s" %d %.1f ms', client, request.method, request.url.path,
                           response.status_code, (time.perf_counter() - start) * 1e3)
        return response

    @app.exception_handler(Exception)
    async def internal_error(request: Any, err: Exception) -> Any:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(error_body(500, f"internal server error: {type(err).__name__}: {err}"),
                            status_code=500)

    add_routes(app, state)
    return app
