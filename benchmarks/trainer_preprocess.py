"""A drafter trainer's own preprocessing (chat template + its loss mask) on datagen completion records.

Runs inside a trainer venv (``tests/support/trainer_venvs.py``), never imports datagen; called by
``benchmarks/compare_trainer_masks.py``::

    python trainer_preprocess.py specforge RECORDS.jsonl TOKENIZER_DIR OUT.jsonl [--template NAME] [--last-turn]
    python trainer_preprocess.py speculators RECORDS.jsonl TOKENIZER_DIR OUT.jsonl

Each record becomes the conversation a user would hand the trainer: its messages, then the generated answer as
the final assistant turn (content, reasoning_content, tool_calls), and its tools. OUT gets one line per record:
``{"index": i, "rows": [[input_ids, loss_mask], ...]}``.

* SpecForge 0.2.0: ``specforge.data.preprocessing.preprocess_conversations``, the function its
  ``build_eagle3_dataset`` maps over the data (called per record here, so rows keep the records' order; the
  map's shuffle is left out), with a template of its ``TEMPLATE_REGISTRY`` and the tokenizer loaded by
  ``AutoTokenizer`` from the tokenizer folder (no model hub here).
* speculators 0.9.0: ``speculators.data_generation.preprocessing._preprocess_batch``, the function
  ``build_speculator_training_dataset`` maps, with one record per batch. It renders through a vLLM server's
  ``/v1/chat/completions/render``; there is no vLLM here, so a stand-in server in this process answers that
  endpoint with ``tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=...)`` token ids (right
  truncation at ``truncate_prompt_tokens``), which is what vLLM's render does with a Hugging Face template; a
  vLLM whose request models drop ``reasoning_content`` would render less.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_LENGTH = 1_000_000  # no truncation: every row whole, as datagen's


def conversation(record: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The record as a chat: its messages plus the generated answer as the last assistant turn."""
    messages = []
    for message in record["messages"]:
        turn = {key: value for key, value in message.items() if value not in (None, "", [])}
        turn["content"] = message.get("content") or ""
        messages.append(turn)
    completion = record["completion"]
    answer: dict[str, Any] = {"role": "assistant", "content": completion.get("content") or ""}
    if completion.get("reasoning_content"):
        answer["reasoning_content"] = completion["reasoning_content"]
    if completion.get("tool_calls"):
        answer["tool_calls"] = completion["tool_calls"]
    return [*messages, answer], record.get("tools")


def specforge_rows(
    records: list[dict[str, Any]], tokenizer_dir: str, template_name: str, last_turn: bool
) -> Any:
    from specforge.data.preprocessing import preprocess_conversations
    from specforge.data.template import TEMPLATE_REGISTRY
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    template = TEMPLATE_REGISTRY.get(template_name)
    for index, record in enumerate(records):
        messages, tools = conversation(record)
        result = preprocess_conversations(
            tokenizer,
            [messages],
            template,
            MAX_LENGTH,
            is_preformatted=False,
            train_only_last_turn=last_turn,
            tools=[tools or []],
        )
        rows = [
            [ids[0].tolist(), mask[0].tolist()]
            for ids, mask in zip(result["input_ids"], result["loss_mask"], strict=True)
        ]
        yield {"index": index, "rows": rows}


def _render_server(tokenizer: Any) -> ThreadingHTTPServer:
    class Render(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids = tokenizer.apply_chat_template(
                body["messages"],
                tools=body.get("tools"),
                add_generation_prompt=body["add_generation_prompt"],
                tokenize=True,
                return_dict=False,
                **(body.get("chat_template_kwargs") or {}),
            )
            limit = body.get("truncate_prompt_tokens")
            if limit is not None:
                ids = ids[:limit] if body.get("truncation_side") == "right" else ids[-limit:]
            data = json.dumps({"token_ids": list(ids)}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Render)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def speculators_rows(records: list[dict[str, Any]], tokenizer_dir: str) -> Any:
    from speculators.data_generation.preprocessing import _preprocess_batch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    server = _render_server(tokenizer)
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for index, record in enumerate(records):
            messages, tools = conversation(record)
            batch = {"conversations": [messages], "tools": [json.dumps(tools) if tools else None]}
            result = _preprocess_batch(batch, False, endpoint, MAX_LENGTH)
            rows = [
                [ids.tolist(), mask.tolist()]
                for ids, mask in zip(result["input_ids"], result["loss_mask"], strict=True)
            ]
            yield {"index": index, "rows": rows}
    finally:
        server.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trainer", choices=["specforge", "speculators"])
    parser.add_argument("records")
    parser.add_argument("tokenizer")
    parser.add_argument("out")
    parser.add_argument("--template", default="qwen3-thinking", help="SpecForge TEMPLATE_REGISTRY name")
    parser.add_argument("--last-turn", action="store_true", help="SpecForge data.train_only_last_turn")
    args = parser.parse_args()
    with open(args.records) as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    if args.trainer == "specforge":
        results = specforge_rows(records, args.tokenizer, args.template, args.last_turn)
    else:
        results = speculators_rows(records, args.tokenizer)
    with open(args.out, "w") as out:
        for result in results:
            out.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
