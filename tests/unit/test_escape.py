"""Text a caller chose is shown as text: markdown artifacts render it escaped."""

from __future__ import annotations

from pathlib import Path

from markdown_it import MarkdownIt

from datagen.app.preflight import Check, PreflightReport
from datagen.config import RunConfig
from datagen.dataset.report import build_report, run_locations
from datagen.escape import markdown_block, markdown_code, markdown_text, printable
from datagen.output.layout import RunLayout
from datagen.output.store import Store
from datagen.records import ShardSummary

# What a caller's `output` would try: close the code span, then a heading, an image and a link to another host,
# and a line that forges a log record (with a terminal escape).
FORGED = (
    "evil`\n# Forged heading\n![pixel](http://evil.example/p.png) [click](http://evil.example/)\n"
    "12:00:00.000 | INFO    | Flow run 'expand-x' - run complete \x1b[2J"
)


def _html(markdown: str) -> str:
    return MarkdownIt("commonmark").render(markdown)


def test_a_report_of_an_output_with_newlines_and_markdown_renders_it_as_text(tmp_path: Path) -> None:
    root = tmp_path / FORGED
    config = RunConfig.model_validate(
        {
            "model": {"path": "/models/m"},
            "datasets": [{"name": "metamath", "format": "metamath", "path": "/data/m.json"}],
            "output": str(root),
        }
    )
    shard = ShardSummary(
        dataset="metamath",
        shard_index=0,
        requests=2,
        completions=1,
        failures=1,
        completion_tokens=10,
        generation_s=1.0,
        completions_path="c",
        failures_path="f",
        failure_reasons={"# Forged reason <img src=x>": 1},
    )
    store, layout = Store(str(root)), RunLayout("r-1")
    version = store.url("datasets/drafter-expansion/v0001.json")
    report = build_report(
        run_id="r-1",
        config=config,
        prepared=[],
        shards=[shard],
        tokenize_summary={
            "dataset_version": "datasets/drafter-expansion/v0001.json",
            "dataset_version_url": version,
        },
        servers=1,
        generation_wall_s=1.0,
        dataset_mix=[],
        mix_by_category=[],
    )

    html = _html(report.to_markdown(run_locations(store, layout, report)))

    assert html.count("<h1>") == 1 and "Forged heading</h1>" not in html
    assert "<img" not in html and 'evil.example/"' not in html and "<h1>Forged" not in html
    assert "Forged heading" in html and "\\n# Forged heading\\n" in html, "the path is shown, escaped"
    assert "\x1b" not in html


def test_a_preflight_detail_naming_a_chosen_output_renders_as_text() -> None:
    report = PreflightReport(
        run_id="r-1", checks=[Check(name="output location", ok=False, detail=f"cannot create {FORGED}")]
    )
    html = _html(report.to_markdown())
    assert html.count("<h1>") == 1 and "<img" not in html and "<a " not in html
    assert "\x1b" not in html


def test_code_spans_and_blocks_hold_any_text() -> None:
    assert _html(markdown_code("a``b\nc")).strip() == "<p><code>a``b\\nc</code></p>"
    block = "\n".join(markdown_block(["run ```", "```", "# not a heading"], "bash"))
    assert "<h1>" not in _html(block) and _html(block).count("<pre>") == 1
    assert _html(markdown_text("1. # - *x* <b>")).strip() == "<p>1. # - *x* &lt;b&gt;</p>"
    assert printable("a\nb\x1b[0m\u2028") == "a\\nb\\x1b[0m\\u2028"
