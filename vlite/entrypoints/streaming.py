"""SSE streaming for the OpenAI routes: per-choice text deltas of a request group (holding back a
possible stop-string start), the ``data:`` lines, and a streaming response that aborts its engine
requests however the stream ends (the client left, or the stream finished).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from vlite.engine import CompletionOutput, RequestOutput, RequestStreamGroup

logger = logging.getLogger("vlite.server")


class ChoiceStreamer:
    """Turns one choice's cumulative output (a CompletionOutput) into text deltas, holding back
    a possible stop-string start (``RequestOutput.stream_holdback`` characters) until it is
    known not to be one. Each choice of an n > 1 request has its own streamer: choices
    finish, and stop, independently."""

    def __init__(self) -> None:
        self.sent_chars = 0
        self.sent_tokens = 0
        self.done = False  # the chunk with this choice's finish_reason has been produced

    def advance(self, c: CompletionOutput, holdback: int) -> tuple[str, int, int]:
        """Returns (new text, first new token index, end token index); marks the choice done
        once ``c`` carries a finish_reason (its text is then final: nothing held back)."""
        finished = c.finish_reason is not None
        end = len(c.text) if finished else max(self.sent_chars, len(c.text) - holdback)
        delta = c.text[self.sent_chars:end]
        self.sent_chars = max(self.sent_chars, end)
        first = self.sent_tokens
        if delta or finished:  # tokens whose text is still held back go with the next delta
            self.sent_tokens = len(c.token_ids)
        self.done = finished
        return delta, first, self.sent_tokens


@dataclass
class ChoiceDelta:
    """What one choice gained in one engine output: new text (``text``, starting at character
    ``text_offset`` of the choice's text), output tokens [first_token, end_token), and
    ``choice`` (the cumulative CompletionOutput; its index is the choice's index within its
    prompt, 0..n-1). ``error`` is set, once per prompt and with no text, when the engine
    failed that prompt's request."""

    prompt_index: int
    out: RequestOutput
    choice: CompletionOutput
    text: str
    text_offset: int
    first_token: int
    end_token: int
    error: str | None = None
    error_kind: str | None = None


class GroupStreamer:
    """Per-choice deltas of a group (one engine request per prompt, ``n`` choices each).

    Iterate it for ChoiceDelta items: one for each choice with new text or that has just
    finished (a finished choice is reported exactly once). ``completion_tokens`` counts the
    output tokens of every choice so far (for ``usage``). Raises RuntimeError if the engine
    loop failed the request.
    """

    def __init__(self, group: RequestStreamGroup, n: int) -> None:
        self.group = group
        self.streamers = [[ChoiceStreamer() for _ in range(n)] for _ in group.request_ids]
        self.tokens = [[0] * n for _ in group.request_ids]
        self.failed = [False] * len(group.request_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(map(sum, self.tokens))

    def __aiter__(self) -> AsyncIterator[ChoiceDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[ChoiceDelta]:
        async for p, out in self.group:
            if self.failed[p]:
                continue
            if out.error or any(c.finish_reason == "error" for c in out.outputs):
                self.failed[p] = True
                c = out.outputs[0] if out.outputs else CompletionOutput(0, "", [], finish_reason="error")
                yield ChoiceDelta(p, out, c, "", 0, 0, 0, error=out.error or "unknown error",
                                  error_kind=out.error_kind)
                continue
            for c in sorted(out.outputs, key=lambda c: c.index):
                st = self.streamers[p][c.index]
                if st.done:
                    continue
                offset = st.sent_chars
                text, first, end = st.advance(c, 0 if out.finished else out.stream_holdback)
                self.tokens[p][c.index] = len(c.token_ids)
                if text or st.done:
                    yield ChoiceDelta(p, out, c, text, offset, first, end)


def sse(payload: BaseModel | dict) -> str:
    """One Server-Sent Event ``data:`` line (OpenAI streaming). Strict JSON: a non-finite number
    raises here rather than reaching the client as a bare ``-Infinity``."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump(mode="json")
    return f"data: {json.dumps(payload, separators=(',', ':'), allow_nan=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class AbortOnCloseStreamingResponse(StreamingResponse):
    """A StreamingResponse that aborts its engine requests however the stream ends.

    Starlette cancels the stream when the client disconnects; the generator may then be left
    suspended, so the abort is done here, where every exit path passes.
    """

    def __init__(self, content: AsyncIterator[str], group: RequestStreamGroup,
                 on_client_left: Callable[[], None] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.group = group
        self.on_client_left = on_client_left  # counts the disconnect (vlite:client_disconnects)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.group.all_finished:
                logger.info("client of %s went away; aborting %s", scope.get("path"), self.group.request_ids)
                if self.on_client_left is not None:
                    self.on_client_left()
            self.group.abort()
