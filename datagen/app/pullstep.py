"""The deployments' pull step: run the flow from the checkout on the worker's host, wherever it is.

``deployments/prefect.yaml`` names :func:`enter_checkout` as its pull step. The worker's flow-run process
calls it before loading the flow: it changes into ``DATAGEN_REPO_DIR`` when set, else into the checkout
the installed ``datagen`` package lives in (``pip install -e .`` from the clone), so no path is baked into
the deployment.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from datagen.errors import ConfigError

logger = logging.getLogger(__name__)

REPO_DIR_ENV = "DATAGEN_REPO_DIR"
ENTRYPOINT_FILE = Path("flows") / "expand.py"


def default_checkout() -> Path:
    """The checkout the installed datagen package was loaded from (its parent folder)."""
    return Path(__file__).resolve().parents[2]


def enter_checkout(directory: str | None = None) -> dict[str, str]:
    """Change the working directory to the datagen checkout on this host (a Prefect pull step).

    Args:
        directory: The checkout; ``$DATAGEN_REPO_DIR`` or the installed package's checkout when empty.

    Returns:
        ``{"directory": <the checkout>}`` (Prefect passes step outputs on to later steps).

    Raises:
        ConfigError: The folder holds no ``flows/expand.py``.
    """
    chosen = directory or os.environ.get(REPO_DIR_ENV) or str(default_checkout())
    path = Path(chosen).expanduser().resolve()
    if not (path / ENTRYPOINT_FILE).is_file():
        raise ConfigError(
            f"{path} is not a datagen checkout (no {ENTRYPOINT_FILE}). Start the worker with "
            f"{REPO_DIR_ENV}=/path/to/your/clone, or `pip install -e .` from the clone.",
            directory=str(path),
        )
    os.chdir(path)
    logger.info("running from checkout directory=%s", path)
    return {"directory": str(path)}
