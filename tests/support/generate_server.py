"""A small SGLang-like server: ``POST /generate`` takes token ids and answers token ids, over a real tokenizer.

It speaks SGLang's native API as datagen uses it (``input_ids`` + ``sampling_params`` in; ``text``,
``output_ids`` and ``meta_info{id, finish_reason{type, matched|length}, prompt_tokens, completion_tokens}``
out), plus ``GET /health``, ``/server_info`` and ``/v1/models``; ``GET /generate`` is refused with 405, as
SGLang's route for POST is. The answer to a request is pseudo-random but deterministic per request key (the
``rid`` before its ``#attempt``, so every attempt of a request gets the same ids), drawn from the tokenizer's
vocabulary:

* a ``<think>...</think>`` block, when the prompt's template left one open (Qwen3.5/3.6) or on a coin flip
  (Qwen3, unless the prompt pre-filled a closed one);
* visible words, then, when the prompt offers tools, sometimes a tool call: JSON (``{"name", "arguments"}``)
  for Qwen3-style prompts, ``<function=...><parameter=...>`` XML for Qwen3.5/3.6-style ones;
* ``<|im_end|>``; or, for about one request in five, more words than ``max_new_tokens`` allows: the
  answer stops on length.

Like SGLang, the stop token stays in ``output_ids`` and is trimmed from ``text``; with ``omit_stop_share``
some answers leave it out of the ids too (engines that do). Every answer sent is recorded
(:attr:`GenerateServer.answers`), so tests can compare training rows with exactly what was served.

Faults are injected as by :class:`~tests.support.fault_server.FaultServer`, with directives found in the
decoded prompt (``[[500,reset]]``...), plus ``abort`` (200 with ``finish_reason.type == "abort"``) and
``garbage`` (200 without ``output_ids``); ``#badtool`` in the prompt makes a tool call whose arguments are
not an object, ``#brokentool`` one that is not valid JSON.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from tests.support.fault_server import FaultPlan, FaultServer, SeenRequest, send_json

GENERATE_PATH = "/generate"
# Vocabulary drawn from: plain tokens that decode to letters, digits and spaces only, so the random text can
# never spell markup by accident.
WORD = re.compile(r"[ A-Za-z0-9]+")
LENGTH_SHARE = 0.2
THINK_SHARE = 0.5
TOOL_CALL_SHARE = 0.6
SERVED_MODEL = "generate-test-model"
MAX_RUNNING_REQUESTS = 64


@dataclass
class ServedAnswer:
    """One 200 answer to ``/generate``, and the parts it was made of."""

    key: str
    rid: str | None
    input_ids: list[int]
    output_ids: list[int]
    finish: str
    text: str
    reasoning: str | None = None
    tool_call: dict[str, Any] | None = None
    sampling_params: dict[str, Any] = field(default_factory=dict)


class GenerateServer(FaultServer):
    """The SGLang-like server; use as a context manager or call start()/stop().

    Args:
        tokenizer_dir: A folder with ``tokenizer.json`` (the target's; the ids it answers come from it).
        plan: Random fault rates, as for FaultServer.
        seed: Varies every answer.
        omit_stop_share: Share of stopped answers whose ids leave the stop token out.
        port: Port to bind (0 picks a free one).

    """

    def __init__(
        self,
        tokenizer_dir: Path,
        *,
        plan: FaultPlan | None = None,
        seed: int = 0,
        omit_stop_share: float = 0.0,
        port: int = 0,
    ) -> None:
        super().__init__(plan, port)
        self.tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        self.seed = seed
        self.omit_stop_share = omit_stop_share
        self.answers: list[ServedAnswer] = []
        self._answers_lock = threading.Lock()
        added = self.tokenizer.get_added_tokens_decoder()
        self.words = [
            token_id
            for token_id in range(self.tokenizer.get_vocab_size())
            if token_id not in added and WORD.fullmatch(self.tokenizer.decode([token_id]) or "")
        ]
        self.ids = {
            name: self._token_id(name)
            for name in ("<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>")
        }

    def _token_id(self, token: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        assert token_id is not None, f"the tokenizer has no {token}"
        return int(token_id)

    def generate_requests(self) -> list[SeenRequest]:
        """The ``/generate`` requests seen so far (every attempt)."""
        with self._lock:
            return [r for r in self.requests if r.path == GENERATE_PATH]

    def answers_by_key(self) -> dict[str, list[ServedAnswer]]:
        """Every 200 answer sent, by request key, in the order sent."""
        with self._answers_lock:
            grouped: dict[str, list[ServedAnswer]] = {}
            for answer in self.answers:
                grouped.setdefault(answer.key, []).append(answer)
            return grouped

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens kept (what datagen asks SGLang for)."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    # --- protocol ---------------------------------------------------------------------------------

    def _content(self, body: dict[str, Any] | None) -> str:
        if body is not None and "input_ids" in body:
            return self.decode(list(body["input_ids"]))
        return super()._content(body)

    async def _respond(self, method: str, path: str, raw: bytes, writer: asyncio.StreamWriter) -> bool:
        if path == GENERATE_PATH:
            if method != "POST":
                await send_json(writer, 405, {"detail": "Method Not Allowed"})
                return True
            body = json.loads(raw) if raw else {}
            problem = _body_problem(body)
            if problem:
                await send_json(writer, 400, {"error": {"message": problem}})
                return True
            fault = self._choose_fault(body)
            with self._lock:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                self.requests.append(SeenRequest(path, body, fault, self.in_flight, time.monotonic()))
            try:
                return await self._answer(fault, body, writer)
            finally:
                with self._lock:
                    self.in_flight -= 1
        if path in ("/server_info", "/get_server_info"):
            info = {"max_running_requests": MAX_RUNNING_REQUESTS, "served_model_name": SERVED_MODEL}
            await send_json(writer, 200, info)
            return True
        if path == "/v1/models":
            await send_json(
                writer, 200, {"object": "list", "data": [{"id": SERVED_MODEL, "object": "model"}]}
            )
            return True
        return await super()._respond(method, path, raw, writer)

    def _success(self, fault: str, body: dict[str, Any], content: str) -> dict[str, Any]:
        if "input_ids" not in body:
            return super()._success(fault, body, content)
        rid = body.get("rid")
        key = str(rid).rsplit("#", 1)[0] if rid else json.dumps(body["input_ids"])
        if fault == "garbage":
            return {"text": "no ids here", "meta_info": {"id": rid}}
        input_ids = list(body["input_ids"])
        answer = self._generate(key, rid, input_ids, body["sampling_params"], content)
        if fault == "abort":
            return {
                "text": "",
                "output_ids": answer.output_ids[:2],
                "meta_info": {
                    "id": rid,
                    "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                    "prompt_tokens": len(input_ids),
                    "completion_tokens": 2,
                },
            }
        with self._answers_lock:
            self.answers.append(answer)
        if answer.finish == "stop":
            finish: dict[str, Any] = {"type": "stop", "matched": self.ids["<|im_end|>"]}
        else:
            finish = {"type": "length", "length": len(answer.output_ids)}
        return {
            "text": answer.text,
            "output_ids": answer.output_ids,
            "meta_info": {
                "id": rid,
                "finish_reason": finish,
                "prompt_tokens": len(input_ids),
                "completion_tokens": len(answer.output_ids),
                "cached_tokens": 0,
                "e2e_latency": 0.001,
            },
        }

    # --- answers ----------------------------------------------------------------------------------

    def _generate(
        self, key: str, rid: str | None, input_ids: list[int], sampling: dict[str, Any], prompt_text: str
    ) -> ServedAnswer:
        rng = random.Random(f"{self.seed}/{key}")
        limit = int(sampling["max_new_tokens"])
        ids = self.ids
        thinking_open = prompt_text.endswith("<think>\n")
        thinking_closed = prompt_text.rstrip().endswith("</think>")
        xml_calls = thinking_open  # Qwen3.5/3.6 templates open the think block and call tools in XML
        planned: list[int] = []
        reasoning_ids: list[int] | None = None
        if thinking_open or (not thinking_closed and rng.random() < THINK_SHARE):
            reasoning_ids = self._words(rng, 3, 10)
            if not thinking_open:
                planned += [ids["<think>"], *self._encode("\n")]
            planned += [*reasoning_ids, ids["</think>"], *self._encode("\n\n")]
        bad_call = "#badtool" in prompt_text or "#brokentool" in prompt_text
        ramble = rng.random() < LENGTH_SHARE and not bad_call
        planned += self._words(rng, limit + 1, limit + 5) if ramble else self._words(rng, 2, 12)
        tool_call = None
        if bad_call:
            if "#badtool" in prompt_text:
                body = '\n{"name": "get_weather", "arguments": ["Paris"]}\n'
            else:
                body = '\n{"name": "get_weather", "arguments": {"city": Paris\n'
            planned += [ids["<tool_call>"], *self._encode(body), ids["</tool_call>"]]
        elif "<tools>" in prompt_text and rng.random() < TOOL_CALL_SHARE:
            tool_call = {"name": "get_weather", "arguments": {"city": rng.choice(["Paris", "Oslo", "Lima"])}}
            body = self._tool_call_body(tool_call, xml_calls)
            planned += [*self._encode("\n\n"), ids["<tool_call>"], *body, ids["</tool_call>"]]
        planned.append(ids["<|im_end|>"])
        if len(planned) > limit:
            output_ids, finish = planned[:limit], "length"
        else:
            output_ids, finish = planned, "stop"
        text_ids = output_ids[:-1] if finish == "stop" else output_ids  # SGLang trims the matched stop
        if finish == "stop" and rng.random() < self.omit_stop_share:
            output_ids = output_ids[:-1]
        reasoning = None
        if reasoning_ids is not None:
            # What the reasoning parser finds between the markers (Qwen3 opens its block with a newline).
            opener = [] if thinking_open else self._encode("\n")
            reasoning = self.decode([*opener, *reasoning_ids])
        return ServedAnswer(
            key=key,
            rid=rid,
            input_ids=input_ids,
            output_ids=output_ids,
            finish=finish,
            text=self.decode(text_ids),
            reasoning=reasoning,
            tool_call=tool_call if finish == "stop" else None,
            sampling_params=dict(sampling),
        )

    def _words(self, rng: random.Random, low: int, high: int) -> list[int]:
        return [rng.choice(self.words) for _ in range(rng.randint(low, high))]

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _tool_call_body(self, call: dict[str, Any], xml: bool) -> list[int]:
        if xml:
            parameters = "".join(
                f"<parameter={name}>\n{value}\n</parameter>\n" for name, value in call["arguments"].items()
            )
            return self._encode(f"\n<function={call['name']}>\n{parameters}</function>\n")
        return self._encode("\n" + json.dumps(call) + "\n")


def _body_problem(body: Any) -> str | None:
    """Why SGLang would refuse the body, for the fields datagen sends (None when it is fine)."""
    if not isinstance(body, dict):
        return "body must be a JSON object"
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(token, int) for token in ids):
        return "input_ids must be a non-empty list of token ids"
    if "text" in body:
        return "send either text or input_ids"
    sampling = body.get("sampling_params")
    if not isinstance(sampling, dict) or not isinstance(sampling.get("max_new_tokens"), int):
        return "sampling_params.max_new_tokens must be set (SGLang's default is 128)"
    return None
