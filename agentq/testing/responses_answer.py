"""The scripted server's Responses API (`POST /v1/responses`): a round played as OpenAI's
typed stream events, each with its `sequence_number`, or as one response object.

Reasoning comes as a reasoning item with a summary and, when the request asks for it
(`include: ["reasoning.encrypted_content"]`), an `encrypted_content` this server can read
back; a request that sends a reasoning item without the item that followed it, or an
`encrypted_content` it did not make, gets OpenAI's 400.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NoReturn

from agentq.testing.scripts import Plan, Round, pieces, usage_counts
from agentq.testing.serving import ClientGone, Conn

RESPONSES_ROUTE = "/v1/responses"
KEEPALIVE_S = 0.05
"""Between the SSE comments of a `keepalive_only` hold."""
_SSE = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_ENC_PREFIX = "gAAAA"


def chat_tools_refusal(model: str) -> str:
    """OpenAI's answer to function tools sent to a reasoning model on Chat Completions."""
    return (
        f"Function tools with reasoning_effort are not supported for {model} in "
        "/v1/chat/completions. To use function tools, use /v1/responses or set "
        "reasoning_effort to 'none'."
    )


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return ""


def input_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages a request's `instructions` and `input` stand for, so both APIs
    choose scripts and rounds alike: the items one model round returned (reasoning, a
    message, function calls) are one assistant message."""
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    open_turn: dict[str, Any] | None = None
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, Mapping):
            continue
        kind = item.get("type", "message")
        role = item.get("role")
        if kind in ("reasoning", "function_call") or (kind == "message" and role == "assistant"):
            if open_turn is None:
                open_turn = {"role": "assistant", "content": ""}
                out.append(open_turn)
            if kind == "message":
                open_turn["content"] += _text_of(item.get("content"))
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function"}
                call["function"] = {"name": item.get("name"), "arguments": item.get("arguments")}
                open_turn.setdefault("tool_calls", []).append(call)
            continue
        open_turn = None
        if kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": ""})
        elif kind == "message":
            out.append({"role": role, "content": _text_of(item.get("content"))})
    return out


def input_problem(body: Mapping[str, Any]) -> str | None:
    """OpenAI's 400 for the request's reasoning items, or None when they are in order."""
    items = body.get("input")
    if not isinstance(items, list):
        return None if isinstance(items, str) else "'input' must be a string or a list of items"
    for position, item in enumerate(items):
        if not isinstance(item, Mapping) or item.get("type") != "reasoning":
            continue
        following = items[position + 1] if position + 1 < len(items) else None
        if not isinstance(following, Mapping) or following.get("type") == "reasoning":
            return (
                f"Item '{item.get('id')}' of type 'reasoning' was provided without its "
                "required following item."
            )
        sealed = item.get("encrypted_content")
        if sealed is not None and _unseal(sealed) is None:
            return f"The encrypted content for item {item.get('id')} could not be verified."
    return None


def _seal(text: str) -> str:
    return _ENC_PREFIX + base64.urlsafe_b64encode(text.encode()).decode()


def _unseal(sealed: object) -> str | None:
    if not isinstance(sealed, str) or not sealed.startswith(_ENC_PREFIX):
        return None
    try:
        return base64.urlsafe_b64decode(sealed[len(_ENC_PREFIX) :]).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


def usage_of(rnd: Round, body: Mapping[str, Any]) -> dict[str, Any]:
    """The round's usage as the Responses API reports it."""
    prompt_chars = len(json.dumps(body.get("input", ""))) + len(str(body.get("instructions", "")))
    cap = body.get("max_output_tokens")
    prompt, completion, cached, reasoning = usage_counts(rnd, prompt_chars, cap)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


async def hold(conn: Conn, *, keepalive: bool) -> NoReturn:
    """Send no data (SSE comments at most) until the client leaves; stop() cancels us."""
    while True:
        if keepalive:
            await conn.send_chunk(b": keep-alive\n\n")
        if await conn.wait_gone(KEEPALIVE_S if keepalive else None):
            raise ClientGone


class ResponsesAnswer:
    """The answer to one Responses request, played on its connection."""

    def __init__(
        self, conn: Conn, plan: Plan, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> None:
        self.conn = conn
        self.plan = plan
        self.body = body
        self.headers = dict(headers)
        self.sequence = 0
        self.response: dict[str, Any] = {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "model": plan.model,
            "output": [],
            "parallel_tool_calls": True,
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "instructions": body.get("instructions"),
            "error": None,
            "incomplete_details": None,
            "max_output_tokens": body.get("max_output_tokens"),
            "metadata": {},
            "store": body.get("store", True),
            "text": body.get("text") or {"format": {"type": "text"}},
            "usage": None,
        }

    def items(self) -> list[dict[str, Any]]:
        """The round's output items, finished."""
        rnd, index = self.plan.round, self.plan.index
        sealed = "reasoning.encrypted_content" in (self.body.get("include") or ())
        out: list[dict[str, Any]] = []
        if rnd.reasoning:
            summary = [{"type": "summary_text", "text": rnd.reasoning}]
            out.append(
                {
                    "id": f"rs_{uuid.uuid4().hex}",
                    "type": "reasoning",
                    "summary": summary,
                    "encrypted_content": _seal(f"{index}:{rnd.reasoning}") if sealed else None,
                }
            )
        if rnd.text:
            part = {"type": "output_text", "text": rnd.text, "annotations": []}
            out.append(
                {
                    "id": f"msg_{uuid.uuid4().hex}",
                    "type": "message",
                    "status": "completed",
                    "role": "assistant",
                    "content": [part],
                }
            )
        for position, call in enumerate(rnd.tool_calls):
            out.append(
                {
                    "id": f"fc_{uuid.uuid4().hex}",
                    "type": "function_call",
                    "status": "completed",
                    "call_id": call.id or f"call_r{index}_{position}",
                    "name": call.name,
                    "arguments": call.arguments_json(),
                }
            )
        return out

    def _finished(self, items: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
        """The closing event's type and its response."""
        incomplete = self.plan.fault == "incomplete"
        status = "incomplete" if incomplete else "completed"
        response = {**self.response, "status": status, "output": items}
        if incomplete:
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if not self.plan.round.omit_usage:
            response["usage"] = usage_of(self.plan.round, self.body)
        return f"response.{status}", response

    async def complete(self) -> None:
        if self.plan.fault in ("silent_after_200", "silent_after_chunks", "keepalive_only"):
            await hold(self.conn, keepalive=False)
        if self.plan.fault == "disconnect":
            return await self.conn.cut()
        _, response = self._finished(self.items())
        payload = json.dumps(response).encode()
        await self.conn.respond(200, payload, {"Content-Type": "application/json", **self.headers})

    def _events(self, items: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], bool]]:
        """(type, fields, carries output) of every event before the closing one."""
        size = self.plan.round.chunk_size
        started: dict[str, Any]
        for at, item in enumerate(items):
            kind, item_id = item["type"], item["id"]
            where = {"item_id": item_id, "output_index": at}
            if kind == "reasoning":
                text = item["summary"][0]["text"]
                started = {**item, "summary": [], "encrypted_content": None}
                yield "response.output_item.added", {"output_index": at, "item": started}, False
                part = {"type": "summary_text", "text": ""}
                at_part = {**where, "summary_index": 0}
                yield "response.reasoning_summary_part.added", {**at_part, "part": part}, False
                for piece in pieces(text, size):
                    yield "response.reasoning_summary_text.delta", {**at_part, "delta": piece}, True
                yield "response.reasoning_summary_text.done", {**at_part, "text": text}, False
                done_part = {"type": "summary_text", "text": text}
                yield "response.reasoning_summary_part.done", {**at_part, "part": done_part}, False
            elif kind == "message":
                text = item["content"][0]["text"]
                started = {**item, "status": "in_progress", "content": []}
                yield "response.output_item.added", {"output_index": at, "item": started}, False
                at_part = {**where, "content_index": 0}
                empty: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
                yield "response.content_part.added", {**at_part, "part": empty}, False
                for piece in pieces(text, size):
                    delta = {**at_part, "delta": piece, "logprobs": []}
                    yield "response.output_text.delta", delta, True
                done = {**at_part, "text": text, "logprobs": []}
                yield "response.output_text.done", done, False
                yield "response.content_part.done", {**at_part, "part": item["content"][0]}, False
            else:
                started = {**item, "status": "in_progress", "arguments": ""}
                yield "response.output_item.added", {"output_index": at, "item": started}, False
                for piece in pieces(item["arguments"], size):
                    yield "response.function_call_arguments.delta", {**where, "delta": piece}, True
                done = {**where, "name": item["name"], "arguments": item["arguments"]}
                yield "response.function_call_arguments.done", done, False
            yield "response.output_item.done", {"output_index": at, "item": item}, False

    async def stream(self) -> None:
        """Stream the round, or as much of it as its fault lets through."""
        await self.conn.start_chunked(200, {**_SSE, **self.headers})
        plan, rnd = self.plan, self.plan.round
        if rnd.raw_chunks is not None:
            for raw in rnd.raw_chunks:
                await self.conn.send_chunk(f"data: {raw}\n\n".encode())
            return await self.conn.end_chunked()
        if plan.fault == "silent_after_200" and await self._fault():
            return
        await self._event("response.created", {"response": self.response})
        await self._event("response.in_progress", {"response": self.response})
        items = self.items()
        fault_at = rnd.fault_after_chunks
        delay_s = rnd.chunk_delay_ms / 1000
        clock = asyncio.get_running_loop().time
        started = clock()
        sent = 0
        for kind, fields, output in self._events(items):
            if output:
                if sent == fault_at and await self._fault():
                    return
                if sent and delay_s:
                    await asyncio.sleep(max(0.0, started + sent * delay_s - clock()))
                sent += 1
            await self._event(kind, fields)
        if sent <= fault_at and await self._fault():
            return
        kind, response = self._finished(items)
        await self._event(kind, {"response": response})
        await self.conn.end_chunked()

    async def _fault(self) -> bool:
        """Play a mid-stream fault; True when the stream must end here."""
        fault = self.plan.fault
        if fault in ("silent_after_200", "silent_after_chunks", "keepalive_only"):
            await hold(self.conn, keepalive=fault == "keepalive_only")
        if fault == "disconnect":
            await self.conn.cut()
            return True
        if fault == "malformed":
            await self.conn.send_chunk(b"event: response.output_text.delta\ndata: {not json\n\n")
            self.plan.fault = None
        if fault == "failed":
            message = self.plan.round.fault_message or "scripted fault: the model failed"
            error = {"code": "server_error", "message": message}
            failed = {**self.response, "status": "failed", "error": error}
            await self._event("response.failed", {"response": failed})
            await self.conn.end_chunked()
            return True
        return False

    async def _event(self, kind: str, fields: dict[str, Any]) -> None:
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        await self.conn.send_chunk(f"event: {kind}\ndata: {data}\n\n".encode())


def reasoning_items(body: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
    """The reasoning items a request sends back (for tests)."""
    items = body.get("input")
    if not isinstance(items, list):
        return []
    return [i for i in items if isinstance(i, Mapping) and i.get("type") == "reasoning"]
