"""Each way a run's parameters reached the box (docs/security.md) is refused before anything happens.

Every payload is what a create-flow-run call carries as the flow run's ``parameters``: the old whole-config
shape (``configs/demo-worker.yaml`` with one field changed) and the field sent as a parameter of its own. Each
goes to the deployed flow's ``validate_parameters``, what the flow engine calls before the flow body (so
before any file is read or training halted), and must be refused with one line that names the field and quotes
nothing sent; the markers show nothing ran, was read, sent, signalled or written. (Through a real API the
server refuses a parameter the flow's signature lacks at create-flow-run, the deployments' parameter schemas
being closed by ``datagen deploy``: test_operations sends the same vectors there.)
"""

from __future__ import annotations

import copy
import http.server
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from datagen.app.run_request import CheckedParameters
from datagen.errors import ConfigError
from datagen.output.runs import read_stored_config
from datagen.output.store import Store
from flows.expand import expand
from flows.host_part import expand_host

REPO = Path(__file__).resolve().parents[2]
DEMO_WORKER = yaml.safe_load((REPO / "configs" / "demo-worker.yaml").read_text())
SECRET = "TOPSECRET-3f9a"


def _whole_config(**changes: Any) -> dict[str, Any]:
    """The old payload: the whole config (demo-worker) with ``changes`` merged into its sections."""
    config = copy.deepcopy(DEMO_WORKER)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def _refused(parameters: dict[str, Any], flow: Any = expand) -> str:
    """The one line the flow refuses ``parameters`` with (its body raises it before anything else)."""
    validated = flow.validate_parameters(parameters)
    refused = validated["config"]
    assert isinstance(refused, CheckedParameters) and refused.request is None, validated
    assert all(value is None for name, value in validated.items() if name != "config"), validated
    with pytest.raises(ConfigError) as raised:
        refused.checked()
    message = str(raised.value)
    assert "\n" not in message, message
    assert message.startswith("Run parameters refused, nothing started: "), message
    assert SECRET not in message, message
    return message


def _refuses_both_shapes(section: str, value: dict[str, Any] | list[Any]) -> None:
    """The old whole config and the section as a parameter are both refused, naming the field."""
    old = _refused({"config_path": "configs/demo-worker.yaml", "config": _whole_config(**{section: value})})
    assert "config_path: not a run parameter" in old
    assert "config: must be the name of one of the box's configs" in old
    new = _refused({"config": "demo-worker", section: value})
    assert f"{section}: not a run parameter; the box's config file alone sets it" in new


@pytest.fixture
def marker(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "ran"
    yield path
    assert not path.exists(), "something ran"


def test_a_restart_command_is_never_a_run_parameter(marker: Path) -> None:
    training = {"kind": "none", "restart_after_run": True, "restart_command": ["touch", str(marker)]}
    _refuses_both_shapes("training", training)


def test_the_servers_environment_is_never_a_run_parameter(marker: Path) -> None:
    env = {"PYTHONSTARTUP": str(marker), "LD_PRELOAD": f"/tmp/{SECRET}.so"}
    _refuses_both_shapes("fleet", {"env": env})


def test_a_model_path_with_remote_code_is_never_a_run_parameter(tmp_path: Path, marker: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"auto_map": {"AutoConfig": "evil.Config"}}')
    (model / "evil.py").write_text(f"open({str(marker)!r}, 'w')\n")
    old = _refused(
        {"config": _whole_config(model={"path": str(model)}, fleet={"extra_args": ["--trust-remote-code"]})}
    )
    assert "config: must be the name" in old
    for section, value in (
        ("model", {"path": str(model)}),
        ("fleet", {"extra_args": ["--trust-remote-code"]}),
    ):
        assert f"{section}: not a run parameter" in _refused({"config": "demo-worker", section: value})


def test_a_run_id_that_climbs_is_refused_before_any_path_is_built(tmp_path: Path) -> None:
    store = tmp_path / "store"
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "config.json").write_text(f'{{"run_id": "{SECRET}"}}')
    message = _refused({"config": "demo-worker", "run_id": "../../secret", "output": str(store)})
    assert "run_id: use 1-80 lowercase letters" in message
    # The core refuses it too, before a key is built from it (the planted file is never read).
    with pytest.raises(ConfigError, match=r"^run_id: use 1-80") as refused:
        read_stored_config(Store(str(store)), "../secret")
    assert SECRET not in str(refused.value)


def test_a_config_path_at_any_yaml_is_refused_without_reading_it(tmp_path: Path) -> None:
    secret = tmp_path / "secret.yaml"
    secret.write_text(f"password: {SECRET}: [unclosed\n")
    message = _refused({"config_path": str(secret)})
    assert "config_path: not a run parameter" in message
    assert "config: required" in message
    for name in (str(secret), "../../" + str(secret), "configs/demo-worker.yaml"):
        assert "config: must be the name of one of the box's configs (" in _refused({"config": name})
    assert (
        "config: no config named 'demo-worker.yaml' on this box; pick one of: demo, demo-watch, demo-worker,"
        in (_refused({"config": "demo-worker.yaml"}))
    )


def test_a_datasets_path_is_never_a_run_parameter(tmp_path: Path) -> None:
    secret = tmp_path / "secret.jsonl"
    secret.write_text(SECRET)
    dataset = {"name": "secret", "format": "openai_messages", "path": str(secret)}
    old = _refused({"config": _whole_config(datasets=[dataset])})
    assert "config: must be the name" in old
    new = _refused({"config": "demo-worker", "datasets": [dataset]})
    assert new.endswith(
        "datasets.0: a name of one of the config's datasets (its path and format are the file's)"
    )


def test_external_urls_are_never_a_run_parameter() -> None:
    received: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(self.path)
            self.send_response(200)
            self.end_headers()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        _refuses_both_shapes("fleet", {"engine": "external", "external_urls": [url]})
    finally:
        server.shutdown()
        server.server_close()
    assert received == []


def test_a_pidfile_training_target_is_never_a_run_parameter(tmp_path: Path) -> None:
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pidfile = tmp_path / "victim.pid"
        pidfile.write_text(str(victim.pid))
        _refuses_both_shapes("training", {"kind": "pidfile", "pidfile": str(pidfile)})
        assert victim.poll() is None, "the process was signalled"
    finally:
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()


def test_protected_prefixes_cannot_be_shrunk_and_output_cannot_reach_the_corpus(tmp_path: Path) -> None:
    corpus = REPO / "datagen" / "samples"  # demo-worker's protected prefix
    before = sorted(path.name for path in corpus.iterdir())
    old = _refused({"config": _whole_config(protected_prefixes=[], output=str(corpus))})
    assert "config: must be the name" in old
    new = _refused({"config": "demo-worker", "protected_prefixes": [], "output": str(corpus)})
    assert "protected_prefixes: not a run parameter" in new
    # `output` alone is a choice, but only under the config's output roots, never at a protected prefix.
    from datagen.app.run_request import RunRequest, resolve_request
    from flows.checked_flow import box_configs

    with pytest.raises(ConfigError, match="output: not under an output root this box allows"):
        resolve_request(RunRequest(config="demo-worker", output=str(corpus)), box_configs())
    assert sorted(path.name for path in corpus.iterdir()) == before


def test_sampling_takes_only_sampling_fields() -> None:
    message = _refused({"config": "demo-worker", "sampling": {"temperature": 0.5, "restart_command": ["sh"]}})
    assert "sampling.restart_command: unknown key; sampling takes only temperature, top_p" in message


def test_the_host_part_refuses_a_whole_config_from_its_parent(marker: Path) -> None:
    training = {"kind": "none", "restart_after_run": True, "restart_command": ["touch", str(marker)]}
    base = {"host": "box-1", "attempt_id": "20261204-010203-abcdef12", "run_id": "r1"}
    old = _refused({**base, "config": _whole_config(training=training)}, expand_host)
    assert "config: must be the name" in old
    new = _refused({**base, "config": "demo-worker", "training": training}, expand_host)
    assert "training: not a run parameter" in new


def test_the_allowed_choices_pass() -> None:
    parameters = {
        "config": "demo-worker",
        "run_id": "r1",
        "max_prompts": 3,
        "series": "nightly",
        "sampling": {"temperature": 0.1},
        "datasets": ["metamath"],
    }
    validated = expand.validate_parameters(parameters)
    assert validated["sampling"].temperature == 0.1
    # The body receives the request parsed once, here: its config name and choices.
    checked = validated["config"]
    assert isinstance(checked, CheckedParameters) and checked.refusal is None
    request = checked.checked()
    assert (request.config, request.run_id, request.max_prompts, request.datasets) == (
        "demo-worker",
        "r1",
        3,
        ["metamath"],
    )
