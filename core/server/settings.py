"""ServeArgs: the flags of `backplane serve` beyond EngineArgs (host, port, auth, limits, chat template).

Like EngineArgs, each field is a flag (`--max-queued-requests`) and a BACKPLANE_* env var
(`BACKPLANE_API_KEY`); the command line wins. No web framework is imported here, so
`backplane --help` works without the `serve` extra.
"""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from backplane.settings import ENV_PREFIX


class ServeArgs(BaseSettings):
    """Options of the HTTP server; the model, backends and plugin groups stay in EngineArgs."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", validate_default=True,
                                      env_ignore_empty=True)

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0: every interface)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0: any free port)")
    api_key: str | None = Field(
        None, description="require 'Authorization: Bearer KEY' on /v1/* (a non-empty key; leave it out for no auth)")
    served_model_name: str | None = Field(None, description="the model id in /v1/models (default: --model)")
    chat_template: str | None = Field(
        None, description="Jinja chat template, a file or inline (default: the tokenizer's)")
    max_queued_requests: int | None = Field(
        None, ge=1, description="requests accepted but not yet started (at least 1: a request waits briefly even "
        "on an idle server); past it, 503 with Retry-After (default: no limit)")
    max_request_bytes: int = Field(1 << 20, ge=1, description="largest request body; larger gets 413")
    shutdown_timeout: float = Field(
        5.0, ge=0, description="seconds in-flight requests may finish after SIGTERM before they are aborted")
    access_log: bool = Field(True, description="log one line per HTTP request (client, method, path, status, time)")
    engine_in_thread: bool = Field(
        False, description="run the engine in a thread of the server process instead of a process of its "
                           "own (the two then share one GIL; which is faster on a GPU is not yet measured)")

    @field_validator("api_key")
    @classmethod
    def _check_api_key(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("expected a non-empty key; leave --api-key out to serve without authentication")
        return value
