"""Run SGLang's own reasoning and tool-call parsers on texts, in a validation venv (tests/support/sglang_venv.py).

``python sglang_parsers.py INTROSPECT_SCRIPT`` reads ``{"cases": [{text, force_reasoning, tool_call_parser,
tools}], "check": {...}}`` on stdin and prints ``{"answers": [...], "check": {...}, "check_error": ...}``: per
case, what SGLang's chat API would put in the message: the reasoning (``ReasoningParser("qwen3")``), then the
calls and the remaining text (``FunctionCallParser`` with the case's parser, only when the case offers tools,
as ``serving_chat`` does), or the error a parser raised; and, when the request has a ``check`` request, what
datagen's introspection script (its path is the argument) answers to it (its ``check``), or the error that
check raised, so the contract test's argvs and bodies of this release ride on the same sglang import. GPU-only
imports are stubbed by that script. Imports nothing from datagen.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import traceback
from typing import Any


def _introspection(introspect_path: str) -> Any:
    """datagen's introspection script, loaded as a module, with its GPU-only stubs installed."""
    spec = importlib.util.spec_from_file_location("sglang_introspect", introspect_path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install_stubs()
    return module


def parse(case: dict[str, Any]) -> dict[str, Any]:
    """What SGLang's chat API makes of one generated text."""
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    reasoning_parser = ReasoningParser(
        model_type="qwen3", stream_reasoning=False, force_reasoning=case["force_reasoning"]
    )
    reasoning, text = reasoning_parser.parse_non_stream(case["text"])
    calls: list[dict[str, Any]] = []
    if case["tools"]:
        tools = [Tool.model_validate(tool) for tool in case["tools"]]
        parser = FunctionCallParser(tools, case["tool_call_parser"])
        if parser.has_tool_call(text or ""):
            text, items = parser.parse_non_stream(text or "")
            calls = [{"name": item.name, "arguments": item.parameters} for item in items]
    return {"reasoning": reasoning, "content": text, "calls": calls}


def main(argv: list[str]) -> int:
    request = json.load(sys.stdin)
    # stdout carries only the JSON answer: sglang and transformers print warnings on import.
    with contextlib.redirect_stdout(sys.stderr):
        introspection = _introspection(argv[1])
        answers = []
        for case in request["cases"]:
            try:
                answers.append(parse(case))
            except Exception as error:
                answers.append({"error": f"{type(error).__name__}: {error}"})
        checked, check_error = None, None
        if request.get("check") is not None:
            try:
                checked = introspection.check(request["check"])
            except Exception:  # the parsers' answers still go out; the contract tests report this
                check_error = "\n".join(traceback.format_exc().strip().splitlines()[-5:])
    json.dump({"answers": answers, "check": checked, "check_error": check_error}, sys.stdout)
    return 0


if __name__ == "__main__":
    # As the introspection script does: this folder's modules must not shadow what sglang imports.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)
    sys.exit(main(sys.argv))
