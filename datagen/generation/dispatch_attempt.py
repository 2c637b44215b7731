"""One try of one request: its body, the HTTP exchange on the server's pool, and what the answer means.

A try never raises (except when cancelled): it returns a :class:`Success` with the completion record, a
:class:`Final` failure, or a :class:`Transient` one that :class:`datagen.generation.retry.RetryPolicy` may
retry, flagged ``server_down`` (nothing listens) or ``suspect`` (a reset or connect timeout: probe it), and
``reset`` or ``timed_out`` for the retry policy and the stall rule.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from datagen.errors import is_transient_http_status
from datagen.generation.dispatch_state import Final, Job, Outcome, ServerState, Success, Transient
from datagen.generation.failures import FailureKind, error_type
from datagen.generation.http import (
    ConnectFailedError,
    ConnectionBrokenError,
    ConnectTimeoutError,
    HttpError,
    MalformedResponseError,
    ResponseTimeoutError,
)
from datagen.generation.openai_chat import (
    CHAT_COMPLETIONS_PATH,
    BadToolArgumentsError,
    UnusableResponseError,
    build_chat_payload,
    excerpt,
    parse_chat_completion,
)
from datagen.generation.sglang_generate import (
    GENERATE_PATH,
    build_request_payload,
    generate_field_names,
    parse_generate_completion,
)
from datagen.records import CompletionRecord, FailureRecord, utc_now

logger = logging.getLogger(__name__)

# Kinds every pending request ends with when the dispatcher stops: one line says so, not one per request.
QUIET_KINDS = frozenset({FailureKind.DISPATCHER_CLOSED, FailureKind.ADMISSION_STOPPED})


class RequestSender:
    """Build, send and classify one try of a request (loop thread only).

    Args:
        model: The model name sent in every request.
        engine: The engine kind (recorded in completions; named when sampling fields are left out).
        unsupported_fields: Sampling fields the engine refuses: left out of every body.
        request_timeout_s: Deadline of one try.
        exact_tokens: Post the prompt's ids to SGLang's ``/generate`` and keep its ``output_ids``, instead of
            OpenAI chat completions.

    """

    def __init__(
        self,
        *,
        model: str,
        engine: str,
        unsupported_fields: frozenset[str],
        request_timeout_s: float,
        exact_tokens: bool,
    ) -> None:
        self.model = model
        self.engine = engine
        self.exact_tokens = exact_tokens
        self.request_timeout_s = request_timeout_s
        self.path = GENERATE_PATH if exact_tokens else CHAT_COMPLETIONS_PATH
        self._dropped_fields = (
            generate_field_names(unsupported_fields) if exact_tokens else unsupported_fields
        )
        self._dropped_fields_logged = False

    def payload(self, job: Job) -> dict[str, Any]:
        """The request body of ``job``'s next try."""
        if self.exact_tokens:
            # The attempt in the rid keeps a retry distinct from an earlier try the server may still run.
            payload = build_request_payload(job.request, rid=f"{job.request.key}#{job.attempts}")
            fields: dict[str, Any] = payload["sampling_params"]
        else:
            payload = fields = build_chat_payload(job.request, self.model)
        if self._dropped_fields:
            dropped = sorted(self._dropped_fields & fields.keys())
            for name in dropped:
                del fields[name]
            if dropped and not self._dropped_fields_logged:
                self._dropped_fields_logged = True
                logger.warning("sampling fields not sent engine=%s fields=%s", self.engine, ",".join(dropped))
        return payload

    async def attempt(self, job: Job, server: ServerState, started: float) -> Outcome:
        """One HTTP try, classified; never raises except on cancellation."""
        assert server.pool is not None
        body = orjson.dumps(self.payload(job))
        try:
            response = await server.pool.request("POST", self.path, body, timeout_s=self.request_timeout_s)
        except ConnectFailedError as error:
            # Nothing listens (refused) or the host is unreachable: the server is down.
            return Transient(reason=f"connection refused: {describe(error)}", server_down=True)
        except ConnectTimeoutError as error:
            return Transient(reason=f"connect timeout: {describe(error)}", suspect=True)
        except ConnectionBrokenError as error:
            # The server may have finished the request before the connection broke: the retry is safe
            # because the request resolves once (one record), whichever try answers.
            return Transient(reason=f"connection reset: {describe(error)}", suspect=True, reset=True)
        except MalformedResponseError as error:
            return Transient(reason=f"malformed response: {describe(error)}", suspect=True)
        except HttpError as error:
            # The request timeout: a slow answer is not proof the server is ill (its silence is judged by
            # the health loop's stall rule, across all its requests).
            return Transient(
                reason=f"{type(error).__name__}: {describe(error)}",
                timed_out=isinstance(error, ResponseTimeoutError),
            )
        status, raw = response.status, response.body
        latency_s = time.monotonic() - started
        if status != 200:
            if is_transient_http_status(status):
                return Transient(reason=f"HTTP {status}: {excerpt(_text(raw))}", status=status)
            return Final(
                reason=f"HTTP {status}: {excerpt(_text(raw))}", kind=FailureKind.HTTP_STATUS, status=status
            )
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            kind = "empty body" if not raw.strip() else f"invalid JSON body: {excerpt(_text(raw))}"
            return Transient(reason=f"HTTP 200 with {kind}", status=status)
        try:
            if self.exact_tokens:
                completion, finish_reason, usage = parse_generate_completion(data, job.request)
            else:
                completion, finish_reason, usage = parse_chat_completion(data)
        except UnusableResponseError as error:
            return Transient(reason=f"HTTP 200 with unusable completion: {error}", status=status)
        except BadToolArgumentsError as error:
            return Final(reason=str(error), kind=FailureKind.INVALID_TOOL_ARGUMENTS, status=status)
        request = job.request
        # Every field is already a validated object (the request's, or built by parse_chat_completion):
        # validating the whole record again would cost more than the rest of the loop's work per request.
        record = CompletionRecord.model_construct(
            prompt_id=request.prompt.prompt_id,
            sample_index=request.sample_index,
            dataset=request.dataset,
            messages=request.prompt.messages,
            tools=request.prompt.tools,
            completion=completion,
            finish_reason=finish_reason,
            usage=usage,
            model=self.model,
            engine=self.engine,
            server=server.url,
            sampling=request.sampling,
            sampling_setting=request.sampling_setting,
            turn=request.turn,
            attempts=job.attempts,
            latency_s=latency_s,
            # Given, not defaulted: pydantic inspects a default factory's signature on every construct.
            created_at=utc_now(),
        )
        return Success(record)


def failure_record(
    job: Job, reason: str, kind: FailureKind, status: int | None, server: str | None = None
) -> FailureRecord:
    """The record of a request that failed (logged, except when the dispatcher stops: everything pending ends then)."""
    request = job.request
    stored = error_type(kind, status)
    if kind not in QUIET_KINDS:
        logger.warning(
            "request failed key=%s error_type=%s attempts=%d reason=%s",
            request.key,
            stored,
            job.attempts,
            reason,
        )
    return FailureRecord(
        prompt_id=request.prompt.prompt_id,
        sample_index=request.sample_index,
        dataset=request.dataset,
        reason=reason,
        error_type=stored,
        attempts=job.attempts,
        last_status=status,
        server=server or job.last_server,
        turn=request.turn,
    )


def describe(error: BaseException) -> str:
    """An error's message, or its class name when it has none."""
    return str(error) or type(error).__name__


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")
