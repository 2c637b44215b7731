"""A value a caller chose stays on its log line: a run's records carry no control characters.

Prefect's real test harness and a real flow run: the core's loggers and the flow's run logger, through the
handlers the run forwards them with (``tasks.runtime.forward_thread_logs``).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from datagen.config import RunConfig
from datagen.output.store import Store

# A chosen output that would forge a second record (a newline, a prefix of Prefect's format) and clear a terminal.
FORGED = "out\n12:00:00.000 | INFO    | Flow run 'expand-x' - run complete \x1b[2J"
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")

pytestmark = pytest.mark.usefixtures("prefect_api")


def test_log_lines_of_a_run_carry_no_control_characters(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from prefect import flow, get_run_logger
    from prefect.context import FlowRunContext

    from datagen.output.runs import open_run
    from tasks.runtime import forward_thread_logs

    output = str(tmp_path / FORGED)
    config = RunConfig.model_validate(
        {
            "run_id": "r-1",
            "model": {"path": "/models/m"},
            "datasets": [{"name": "metamath", "format": "metamath", "path": "/data/m.json"}],
            "output": output,
        }
    )
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    keep = Keep()
    flow_runs = logging.getLogger("prefect.flow_runs")
    flow_runs.addHandler(keep)
    logging.getLogger("datagen").addHandler(keep)

    @flow(name="escape-logs")
    def logs_a_chosen_output() -> None:
        context = FlowRunContext.get()
        assert context is not None and context.flow_run is not None
        with forward_thread_logs(str(context.flow_run.id)):
            open_run(Store(output), config)  # the core's "created run ... url=<output>/runs/r-1"
            get_run_logger().info("run output=%s", output)

    try:
        with caplog.at_level(logging.INFO):
            logs_a_chosen_output()
    finally:
        flow_runs.removeHandler(keep)
        logging.getLogger("datagen").removeHandler(keep)
    messages = [record.getMessage() for record in seen]
    assert any(message.startswith("created run run_id=r-1") for message in messages), messages
    assert any(message.startswith("run output=") for message in messages), messages
    assert not [message for message in messages if CONTROL.search(message)], messages
    assert any("out\\n12:00:00.000 | INFO" in message for message in messages), "shown, escaped"
