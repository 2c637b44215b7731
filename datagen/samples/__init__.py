"""Small sample files, one per dataset format, in each dataset's real layout and file type.

The demo and the docs use them; each holds a handful of realistic rows, some of them deliberately bad
so that rejections show up in the counts. They are written by ``tests/fixtures/datasets/build_samples.py``.
"""

from __future__ import annotations

from pathlib import Path

from datagen.errors import DatasetError

SAMPLES_DIR = Path(__file__).resolve().parent
# The file type of each format's sample: the type the real dataset is published in.
SAMPLE_FILES: dict[str, str] = {
    "infinity_instruct": "infinity_instruct.parquet",
    "webinstruct": "webinstruct.parquet",
    "codefeedback_filtered": "codefeedback_filtered.jsonl",
    "code_feedback": "code_feedback.jsonl",
    "metamath": "metamath.json",
    "hermes_fc": "hermes_fc.json",
    "agentinstruct": "agentinstruct.parquet",
    "toucan": "toucan.parquet",
    "sharegpt": "sharegpt.json",
    "openai_messages": "openai_messages.jsonl",
}


def sample_path(format: str) -> str:
    """The path of the bundled sample file of a dataset format.

    Args:
        format: A :data:`datagen.config.DatasetFormat`.

    Returns:
        The absolute path of the sample file.

    Raises:
        DatasetError: No sample exists for ``format``.

    """
    try:
        return str(SAMPLES_DIR / SAMPLE_FILES[format])
    except KeyError:
        raise DatasetError(
            f"No bundled sample for dataset format {format!r}; samples exist for: {', '.join(SAMPLE_FILES)}"
        ) from None
