"""The Prefect UI's JSON mode: free-form mapping fields as its form submits them, unwrapped before validation.

The form's JSON mode sends a mapping field as ``{"__prefect_kind": "json", "value": "<json text>"}`` nested in the
parameters, where Prefect's server does not unwrap it; the published schema must also accept any object there.
Every free-form mapping of the config (``fleet.env``, ``mix.category_caps``...) is annotated with these.
"""

from __future__ import annotations

import json
from typing import Any, Final

from pydantic import BeforeValidator, WithJsonSchema

# How the Prefect UI's form encodes the value of a free-form mapping field: its JSON text in a wrapper. The form's
# JSON mode sends such wrappers nested in the parameters, where Prefect's server does not unwrap them.
UI_JSON_KIND_KEY: Final = "__prefect_kind"


def unwrap_ui_json(value: Any) -> Any:
    """Turn the UI's ``{"__prefect_kind": "json", "value": "<json>"}`` back into the mapping it encodes."""
    if isinstance(value, dict) and value.get(UI_JSON_KIND_KEY) == "json":
        text = value.get("value")
        if text is None or (isinstance(text, str) and not text.strip()):
            return {}
        if isinstance(text, str):
            try:
                return json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"not valid JSON: {error}") from None
        return text
    return value


# A free-form mapping field as the Prefect UI can submit it: any object in the published schema (the form's
# JSON mode nests the wrapper above, which a typed schema would reject), unwrapped and typed here.
UI_MAPPING_SCHEMA: Final = {"type": "object", "additionalProperties": True}
UNWRAP_UI_JSON: Final = BeforeValidator(unwrap_ui_json)
UI_MAPPING: Final = WithJsonSchema(UI_MAPPING_SCHEMA)
UI_OPTIONAL_MAPPING: Final = WithJsonSchema({"anyOf": [UI_MAPPING_SCHEMA, {"type": "null"}]})
