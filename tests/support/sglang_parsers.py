"""Run SGLang's own reasoning and tool-call parsers on texts, in a validation venv (tests/support/sglang_venv.py).

``python sglang_parsers.py INTROSPECT_SCRIPT`` reads ``{"cases": [{text, force_reasoning, tool_call_parser,
tools}]}`` on stdin and prints, per case, what SGLang's chat API would put in the message: the reasoning
(``ReasoningParser("qwen3")``), then the calls and the remaining text (``FunctionCallParser`` with the case's
parser, only when the case offers tools, as ``serving_chat`` does), or the error a parser raised. GPU-only
imports are stubbed by datagen's introspection script (its path is the argument). Imports nothing from datagen.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from typing import Any


def _install_stubs(introspect_path: str) -> None:
    spec = importlib.util.spec_from_file_location("sglang_introspect", introspect_path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install_stubs()


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
    _install_stubs(argv[1])
    request = json.load(sys.stdin)
    answers = []
    for case in request["cases"]:
        try:
            answers.append(parse(case))
        except Exception as error:
            answers.append({"error": f"{type(error).__name__}: {error}"})
    json.dump({"answers": answers}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
