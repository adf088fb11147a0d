"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API (text only) over the
chat pipeline.

A Responses request is a chat request: ``instructions`` become a system message, ``input`` (a
string is one user message) the messages after it, and ``previous_response_id`` puts the stored
conversation of that response (its messages and its answer) before them. The chat handler
(``serving_chat.OpenAIServingChat``) runs it, so validation, the engine request, cancellation
and the abort of a stream whose client left are the chat route's; this module only reshapes the
answer: a ``response`` object, or a stream of ``response.*`` events (``response.created``,
``response.output_text.delta`` per piece of text, then ``response.completed`` or
``response.incomplete`` with the whole response; an engine error is ``response.failed``).

``store`` (default true, as OpenAI's) keeps the response and its conversation in the server's
``ResponseStore`` (``response_store.py``, bounded by size and age). ``background`` is refused (400).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from vlite.entrypoints.errors import APIError
from vlite.entrypoints.protocol import ChatCompletionRequest, ResponsesRequest
from vlite.entrypoints.serving_chat import OpenAIServingChat
from vlite.entrypoints.state import ServerState
from vlite.entrypoints.streaming import AbortOnCloseStreamingResponse


def _input_messages(req: ResponsesRequest) -> list[dict]:
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    return [{"role": m.role, "content": m.content if isinstance(m.content, str)
             else "".join(part.text for part in m.content)} for m in req.input]


class OpenAIServingResponses:
    """One Responses API request: its conversation, the chat handler's answer reshaped, the store."""

    def __init__(self, req: ResponsesRequest, request: Request, state: ServerState) -> None:
        self.req, self.request, self.state = req, request, state
        uid = uuid.uuid4().hex
        self.response_id, self.message_id = f"resp_{uid}", f"msg_{uid}"
        self.created_at = int(time.time())

    def conversation(self) -> list[dict]:
        """The chat messages: the previous response's conversation, ``instructions``, ``input``.

        Raises:
            APIError: 404 for a ``previous_response_id`` that is not stored (or has expired).
        """
        messages: list[dict] = []
        if self.req.previous_response_id is not None:
            stored = self.state.responses.get(self.req.previous_response_id)
            if stored is None:
                raise APIError(404, f"previous response {self.req.previous_response_id!r} "
                               f"{_not_stored(self.state)}", param="previous_response_id")
            messages = [m for m in stored[0] if m["role"] != "system"]
        if self.req.instructions:
            messages.insert(0, {"role": "system", "content": self.req.instructions})
        return messages + _input_messages(self.req)

    async def serve(self) -> Response:
        """Answer through the chat pipeline.

        Raises:
            APIError: 400 for ``background`` or what the chat route refuses, 404 for an unknown
                ``previous_response_id`` or model, 500/503 as the chat route.
        """
        req = self.req
        if req.background:
            raise APIError(400, "background responses are not supported", param="background")
        messages = self.conversation()
        fields = {"model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
                  "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream, "user": req.user}
        if req.stream:
            fields["stream_options"] = {"include_usage": True}
        try:
            chat_req = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:  # the fields were checked already; a message the chat route refuses
            raise APIError(400, f"input: {exc.errors()[0].get('msg', 'invalid')}", param="input") from None
        answer = await OpenAIServingChat(chat_req, self.request, self.state).serve()
        if isinstance(answer, AbortOnCloseStreamingResponse):
            answer.body_iterator = self._events(answer.body_iterator, messages)
            return answer
        data = json.loads(answer.body)
        if answer.status_code != 200 or "choices" not in data:
            return answer
        choice = data["choices"][0]
        response = self._response(choice["message"].get("content") or "", choice.get("finish_reason"),
                                  data.get("usage") or {})
        self._keep(response, messages)
        return JSONResponse(response)

    def _response(self, text: str, finish_reason: str | None, usage: dict, status: str | None = None) -> dict:
        """The ``response`` object: completed, or incomplete for a length finish."""
        status = status or ("incomplete" if finish_reason == "length" else "completed")
        return {"id": self.response_id, "object": "response", "created_at": self.created_at,
                "model": self.state.model_name if self.req.model is None else self.req.model, "status": status,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "previous_response_id": self.req.previous_response_id, "store": self.req.store,
                "instructions": self.req.instructions,
                "output": [{"type": "message", "id": self.message_id, "status": "completed",
                            "role": "assistant", "content": [{"type": "output_text", "text": text,
                                                              "annotations": []}]}],
                "usage": {"input_tokens": usage.get("prompt_tokens", 0),
                          "output_tokens": usage.get("completion_tokens", 0),
                          "total_tokens": usage.get("total_tokens", 0)}}

    def _keep(self, response: dict, messages: list[dict]) -> None:
        if self.req.store and response["status"] in ("completed", "incomplete"):
            text = response["output"][0]["content"][0]["text"]
            self.state.responses.put(response, messages + [{"role": "assistant", "content": text}])

    async def _events(self, chunks: AsyncIterator[str], messages: list[dict]) -> AsyncIterator[str]:
        """The chat stream's chunks as Responses API events (the chat stream's abort on close is kept:
        closing this generator closes it)."""
        seq = 0

        def event(kind: str, **body) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **body})}\n\n"

        texts: list[str] = []
        finish, usage = None, {}
        yield event("response.created", response=self._response("", None, {}, status="in_progress"))
        try:
            async for chunk in chunks:
                payload = chunk[len("data: "):].strip() if chunk.startswith("data: ") else ""
                if not payload or payload == "[DONE]":
                    continue
                data = json.loads(payload)
                if "error" in data:
                    yield event("response.failed", response=self._response("".join(texts), None, usage,
                                                                           status="failed"), error=data["error"])
                    return
                usage = data.get("usage") or usage
                for choice in data.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        texts.append(piece)
                        yield event("response.output_text.delta", item_id=self.message_id,
                                    output_index=0, content_index=0, delta=piece)
                    finish = choice.get("finish_reason") or finish
        finally:
            await chunks.aclose()
        response = self._response("".join(texts), finish, usage)
        self._keep(response, messages)
        yield event(f"response.{response['status']}", response=response)


def _not_stored(state: ServerState) -> str:
    return (f"not found (never stored, or dropped: the store keeps {state.responses.max_entries} responses for "
            f"{state.responses.ttl_s:g} s)")


def stored_response(state: ServerState, response_id: str) -> dict:
    """GET /v1/responses/{id}: the stored response.

    Raises:
        APIError: 404 when it was not stored or has been dropped.
    """
    stored = state.responses.get(response_id)
    if stored is None:
        raise APIError(404, f"response {response_id!r} {_not_stored(state)}")
    return stored[1]
