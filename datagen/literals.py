"""Values written loosely: JSON, or a Python literal (single quotes, True/False/None).

Shared by prompt preparation (tool calls in dataset rows) and generation (Qwen's XML tool parameters), which
may not import each other.
"""

from __future__ import annotations

import ast
import json
from typing import Any


def parse_loose(text: str, *, json_first: bool = True) -> Any:
    """Parse ``text`` as JSON, or failing that as a Python literal.

    The text is parsed as given: callers strip it where surrounding white space is not part of the value
    (SGLang's XML parameter parser does not, and generation matches it).

    Args:
        text: What to parse.
        json_first: False to try only the Python literal (SGLang parses XML parameters of a scalar or unknown
            schema type that way).

    Returns:
        The parsed value.

    Raises:
        ValueError: ``text`` is neither.

    """
    if json_first:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as error:
        raise ValueError(f"neither JSON nor a Python literal: {error}") from None
