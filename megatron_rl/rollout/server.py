"""The HTTP server of `megatron-rl serve`, in front of any RolloutEngine (normally the native engine),
on FastAPI + uvicorn. It speaks SGLang's native API (rollout/sglang_api.py, which lists its endpoints;
/generate in sglang_generate.py) and OpenAI's /v1 API (rollout/openai_api.py); requests from every
endpoint share the engine's continuous batch. docs/serving.md documents both.

Errors are OpenAI error objects {"error": {message, type, param, code}} naming the field; a field we
cannot honour is refused, never ignored. With an API key every endpoint but /health needs
`Authorization: Bearer <key>`. The server binds 127.0.0.1 unless told otherwise.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from megatron_rl.config import ConfigError
from megatron_rl.rollout.engine import RequestError
from megatron_rl.rollout.openai_api import add_openai_routes
from megatron_rl.rollout.openai_tools import PARSERS
from megatron_rl.rollout.serving import APIError, ClientGone, EngineBridge, ServerLimits, error_body, version_spans
from megatron_rl.rollout.sglang_api import add_sglang_routes

log = logging.getLogger(__name__)


class RolloutServer:
    """Owns the HTTP server; `serve_forever()` blocks, `start()` serves from a daemon thread."""

    def __init__(self, engine: Any, *, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None,
                 tokenizer: Any = None, model_path: str = "", model_name: str | None = None,
                 limits: ServerLimits | None = None, backlog: int = 4096, tool_call_parser: str = "auto"):
        self.engine = engine
        self.tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        self.api_key = api_key or None
        self.model_path = model_path
        self.model_name = model_name or (os.path.basename(model_path.rstrip("/")) if model_path else "megatron-rl")
        self.limits = limits or ServerLimits()
        if tool_call_parser not in PARSERS:
            raise ConfigError(f"tool_call_parser: unknown parser {tool_call_parser!r} "
                              f"(choose from {', '.join(PARSERS)})")
        self.tool_call_parser = tool_call_parser
        self.bridge = EngineBridge(engine, self.limits)
        self.started_at = int(time.time())
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # bound here so that a busy port is reported at once and port 0 gets its number before serving;
        # a long listen queue so that bursts of clients wait instead of being reset
        self.socket = socket.create_server((host, port), family=family, backlog=backlog)
        self.app = self._build_app()
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off", backlog=backlog,
                                timeout_keep_alive=30)
        self._uvicorn = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.socket.getsockname()[:2]
        return host, port

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> RolloutServer:
        self._thread = threading.Thread(target=self.serve_forever, name="rollout-http", daemon=True)
        self._thread.start()
        while not self._uvicorn.started and self._thread.is_alive():
            time.sleep(0.01)
        return self

    def serve_forever(self) -> None:
        asyncio.run(self._uvicorn.serve(sockets=[self.socket]))

    def shutdown(self) -> None:
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.socket.close()

    # --- app ----------------------------------------------------------------------------------------
    def _authorise(self, request: Request) -> None:
        if self.api_key is None or request.url.path in ("/health", "/health_generate"):
            return
        header = request.headers.get("authorization", "")
        if not (header.startswith("Bearer ") and hmac.compare_digest(header[7:].encode(), self.api_key.encode())):
            raise APIError(401, "missing or wrong API key (Authorization: Bearer <key>)", code="invalid_api_key")

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="megatron-rl serve", docs_url=None, redoc_url=None, openapi_url=None,
                      dependencies=[Depends(self._authorise)])
        _add_error_handlers(app)
        add_sglang_routes(app, self)
        add_openai_routes(app, self)
        return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(error_body(400, str(exc), exc.field), status_code=400)

    @app.exception_handler(ValueError)
    async def value_error(request: Request, exc: ValueError) -> JSONResponse:  # config errors: the client's
        return JSONResponse(error_body(400, str(exc)), status_code=400)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no endpoint {request.url.path}",
                   405: f"{request.url.path} does not accept {request.method}"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("error serving %s", request.url.path)
        return JSONResponse(error_body(500, f"{type(exc).__name__}: {exc}"), status_code=500)


__all__ = ["RequestError", "RolloutServer", "ServerLimits", "version_spans"]
