"""A toy OpenAI-compatible inference server, for the router's tests, the demo and the bench.

`python -m lanes_sandbox.toy_replica --model M --version V [--port 0] [--token-delay-ms N]
[--first-token-delay-ms N] [--tokens N]` serves `/health`, `/v1/models`, `/v1/chat/completions` and
`/v1/completions` (streaming over SSE or not, with `usage` token counts) and prints the line vLLM's server
prints once it listens, so a launcher finds its endpoint the same way. `POST /control` switches failure
modes at run time (see `Behaviour`); `GET /control` returns what it served (including the most requests it
ever had in flight at once, which is how tests check concurrency caps from the replica's side).

Answers are a pure function of the request: token i is `tok<i> `, the completion id derives from the
`X-Request-Id` header, `created` is fixed and the fingerprint names only the model and version. A
continuation (a chat whose final assistant message is continued with `continue_final_message`, or a
completion prompt that ends with the answer so far) resumes at the next token, so a stream cut and
continued on another toy replica is byte for byte the stream never cut.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import signal
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from aiohttp import web

Mode = Literal["ok", "fail", "hang", "die_after", "stall_after", "slow_first_token"]
CREATED = 1_700_000_000
"""Every answer's `created`: a clock in the answer would make two runs of one request differ."""


@dataclass
class Behaviour:
    """How the replica answers; every field can be changed with `POST /control`."""

    mode: Mode = "ok"
    """ok; fail (answer `fail_status`); hang (never answer); die_after (drop the connection after
    `after_tokens` tokens); stall_after (go silent after `after_tokens` tokens, the connection kept open, as a
    hung or lost node looks); slow_first_token (wait `slow_first_token_ms` before the first byte)."""
    fail_status: int = 500
    after_tokens: int = 2
    slow_first_token_ms: int = 5000
    health: Literal["ok", "fail"] = "ok"
    tokens: int = 8
    token_delay_ms: float = 0.0
    first_token_delay_ms: float = 0.0


@dataclass
class Counters:
    """What the replica has served since start (or the last reset)."""

    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    health_checks: int = 0


class ToyReplica:
    """The server's state: its identity, its behaviour and its counters."""

    def __init__(self, model: str, version: str, behaviour: Behaviour) -> None:
        self.model = model
        self.version = version
        self.behaviour = behaviour
        self._changed = asyncio.Event()
        """Set (and replaced) each time the control changes the behaviour."""
        self.counters = Counters()
        self.fingerprint = f"{model}@{version}"
        self.rank = os.environ.get("RANK")

    def application(self) -> web.Application:
        """The routes."""
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/control", self._stats)
        app.router.add_post("/control", self._control)
        return app

    async def _health(self, _request: web.Request) -> web.Response:
        self.counters.health_checks += 1
        return web.Response(status=200 if self.behaviour.health == "ok" else 503)

    async def _models(self, _request: web.Request) -> web.Response:
        model = {"id": self.model, "object": "model", "created": 0, "owned_by": "lanes-toy", "version": self.version}
        return web.json_response({"object": "list", "data": [model]})

    async def _stats(self, _request: web.Request) -> web.Response:
        body = asdict(self.counters) | {"model": self.model, "version": self.version, "pid": os.getpid()}
        return web.json_response(body | {"behaviour": asdict(self.behaviour)})

    async def _control(self, request: web.Request) -> web.Response:
        try:
            changes = await request.json()
        except ValueError:
            return web.json_response({"error": "body must be JSON"}, status=400)
        if not isinstance(changes, dict):
            return web.json_response({"error": "body must be a JSON object"}, status=400)
        if changes.pop("reset_stats", False):
            self.counters = Counters(in_flight=self.counters.in_flight)
        known = {f.name for f in fields(Behaviour)}
        unknown = set(changes) - known
        if unknown:
            return web.json_response({"error": f"unknown fields {sorted(unknown)}"}, status=400)
        self.behaviour = Behaviour(**(asdict(self.behaviour) | changes))
        self._changed.set()  # a request waiting on the old first-token delay reads the new one
        self._changed = asyncio.Event()
        return await self._stats(request)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def _complete(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        counters = self.counters
        counters.requests += 1
        counters.in_flight += 1
        counters.max_in_flight = max(counters.max_in_flight, counters.in_flight)
        try:
            return await self._answer(request, chat=chat)
        finally:
            counters.in_flight -= 1

    async def _first_token_wait(self) -> None:
        """Wait the first-token delay as the control says it now.

        A test holds a request with a long delay and lets it go by setting a short one, instead of racing a
        fixed delay on a busy machine.
        """
        loop = asyncio.get_running_loop()
        began = loop.time()
        while (left := self.behaviour.first_token_delay_ms / 1000 - (loop.time() - began)) > 0:
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)

    async def _answer(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body: Any = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict) or body.get("model") != self.model:
            return _error(404, f"this server serves {self.model!r}")
        behaviour = self.behaviour
        if behaviour.mode == "fail":
            return _error(behaviour.fail_status, "the toy replica was told to fail")
        if behaviour.mode == "hang":
            await asyncio.sleep(3600)
        if behaviour.mode == "slow_first_token":
            await asyncio.sleep(behaviour.slow_first_token_ms / 1000)
        if behaviour.first_token_delay_ms:
            await self._first_token_wait()
        try:
            start = _already_generated(body, chat=chat)
        except ValueError as exc:
            return _error(400, str(exc))
        limit = body.get("max_tokens")
        end = min(behaviour.tokens, start + limit) if isinstance(limit, int) and limit > 0 else behaviour.tokens
        count = max(0, end - start)
        usage = {"prompt_tokens": _prompt_tokens(body), "completion_tokens": count}
        usage["total_tokens"] = usage["prompt_tokens"] + count
        given = request.headers.get("X-Request-Id") or uuid_hex()
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{hashlib.sha256(given.encode()).hexdigest()[:24]}"
        if body.get("stream") is True:
            return await self._stream(
                request, body, chat=chat, tokens=range(start, end), usage=usage, request_id=request_id
            )
        if behaviour.mode == "die_after" and request.transport is not None:
            request.transport.close()
            return web.Response(status=500)
        if behaviour.token_delay_ms:
            await asyncio.sleep(count * behaviour.token_delay_ms / 1000)
        text = "".join(_token(i) for i in range(start, end))
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
        choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        answer = self._envelope(request_id, "chat.completion" if chat else "text_completion")
        return web.json_response(answer | {"choices": [choice], "usage": usage})

    def _envelope(self, request_id: str, kind: str) -> dict[str, Any]:
        return {
            "id": request_id,
            "object": kind,
            "created": CREATED,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        *,
        chat: bool,
        tokens: range,
        usage: dict[str, int],
        request_id: str,
    ) -> web.StreamResponse:
        behaviour = self.behaviour
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        envelope = self._envelope(request_id, "chat.completion.chunk" if chat else "text_completion")
        for sent, i in enumerate(tokens):
            if behaviour.mode == "die_after" and sent >= behaviour.after_tokens and request.transport is not None:
                request.transport.close()  # the replica "dies" mid-stream: the connection drops without [DONE]
                return response
            if behaviour.mode == "stall_after" and sent >= behaviour.after_tokens:
                await asyncio.sleep(3600)
            if sent and behaviour.token_delay_ms:
                await asyncio.sleep(behaviour.token_delay_ms / 1000)
            token = _token(i)
            if chat:
                delta = {"role": "assistant", "content": token} if i == 0 else {"content": token}
                choice: dict[str, Any] = {"index": 0, "delta": delta}
            else:
                choice = {"index": 0, "text": token}
            choice["finish_reason"] = "stop" if i == tokens.stop - 1 else None
            await response.write(_event(envelope | {"choices": [choice]}))
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage") is True:
            await response.write(_event(envelope | {"choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _token(index: int) -> str:
    return f"tok{index} "


def uuid_hex() -> str:
    """A fresh id for a request that named none (its answer is then not reproducible, as with any server)."""
    return os.urandom(12).hex()


def _already_generated(body: dict[str, Any], *, chat: bool) -> int:
    """How many tokens of the answer the request already carries (a continuation), 0 for a new request.

    The text must be exactly the toy's own first tokens: a router that lost or doubled one is told so.
    """
    if chat:
        messages = body.get("messages")
        last = messages[-1] if isinstance(messages, list) and messages else None
        if body.get("continue_final_message") is not True or not isinstance(last, dict):
            return 0
        if last.get("role") != "assistant":
            return 0
        text = str(last.get("content", ""))
    else:
        prompt = body.get("prompt")
        text = prompt if isinstance(prompt, str) else ""
        at = text.find(_token(0))
        text = text[at:] if at >= 0 else ""
        if text != "".join(_token(i) for i in range(len(text.split()))):
            return 0  # a prompt that merely mentions a token is a new request
    words = len(text.split())
    if text != "".join(_token(i) for i in range(words)):
        msg = f"cannot continue {text[:80]!r}: it is not this model's answer so far"
        raise ValueError(msg)
    return words


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "toy_error", "param": None, "code": status}}
    return web.json_response(body, status=status)


def _prompt_tokens(body: dict[str, Any]) -> int:
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(len(str(m.get("content", "")).split()) for m in messages if isinstance(m, dict))
    return len(str(body.get("prompt", "")).split())


async def serve(host: str, port: int, replica: ToyReplica) -> None:
    """Listen, announce the endpoint on stdout as vLLM does, and serve until SIGTERM or SIGINT."""
    runner = web.AppRunner(replica.application(), access_log=None, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    bound = next(address for address in runner.addresses if isinstance(address, tuple))
    print(f"INFO:     Uvicorn running on http://{host}:{bound[1]} (Press CTRL+C to quit)", flush=True)  # noqa: T201 - the announcement launchers parse
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        with contextlib.suppress(Exception):
            await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    """Entry point: parse the options and serve."""
    parser = argparse.ArgumentParser(prog="python -m lanes_sandbox.toy_replica", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument(
        "--host",
        default=os.environ.get("LANES_NODE_ADDRESS", "127.0.0.1"),
        help="default: the node's address when a Lanes agent runs it (LANES_NODE_ADDRESS), else loopback",
    )
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per answer (max_tokens can lower it)")
    parser.add_argument("--token-delay-ms", type=float, default=0.0)
    parser.add_argument("--first-token-delay-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    behaviour = Behaviour(
        tokens=args.tokens, token_delay_ms=args.token_delay_ms, first_token_delay_ms=args.first_token_delay_ms
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.host, args.port, ToyReplica(args.model, args.version, behaviour)))


if __name__ == "__main__":
    main()
