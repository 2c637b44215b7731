"""A flow whose run parameters are checked, once, before Prefect validates them, and the configs it may pick."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from prefect import Flow

from datagen.app.run_request import CheckedParameters, RunRequest, configs_folder, parse_run_request
from datagen.errors import ConfigError

R = TypeVar("R")

# The checkout this flow runs from: its configs/ folder holds the configs a run may pick by name.
CHECKOUT = Path(__file__).resolve().parents[1]


def box_configs() -> Path:
    """The box's configs a run may pick by name: ``configs/`` of the worker's checkout."""
    return configs_folder(CHECKOUT)


class CheckedFlow(Flow[..., R]):
    """A flow whose run parameters are parsed as ``request_model`` before Prefect validates them.

    A deployment's flow run gets its parameters from whoever started it. The request model (of
    :mod:`datagen.app.run_request`) refuses a value that is no run choice (a run id that climbs, a config the
    box lacks) in one line that names the parameter and the fix, before the flow reads any file or starts
    anything. A parameter the signature lacks (``config_path``, ``training``...) the server refuses at
    create-flow-run (``datagen deploy`` closes the deployments' parameter schemas), and Prefect on a worker for
    a run that skipped that check; the model refuses it too when the flow is called in-process.

    The body receives the outcome as its ``config`` parameter, a :class:`CheckedParameters` (every other
    parameter None when refused), and reads it with :func:`datagen.app.run_request.checked_request`: raised
    from here instead, Prefect would log its engine's traceback and keep the random name it gave the run.
    """

    def __init__(self, fn: Callable[..., R], request_model: type[RunRequest], **options: Any) -> None:
        super().__init__(fn=fn, **options)
        self.request_model = request_model

    def validate_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        """Parse the run request (a refusal goes to the body, see above), then validate as Prefect does."""
        try:
            request = parse_run_request(parameters, box_configs(), self.request_model)
        except ConfigError as refusal:
            refused: CheckedParameters[RunRequest] = CheckedParameters(refusal=refusal)
            return {name: refused if name == "config" else None for name in self.parameters.required}
        validated = super().validate_parameters(parameters)
        validated["config"] = CheckedParameters(request=request)
        return validated
