"""One migrated Prefect database per test session, copied into every Prefect home the tests start a server on.

A Prefect API server on an empty SQLite file migrates it first: about 6 s of CPU on this 2-core machine, on
top of the ~4 s any start costs. The suite starts servers on about a dozen fresh homes (the per-worker home, the
test harness, each `prefect server start` stack, the crash chain's home...), so it migrates once, here, and
copies the result. The copy is a real database, migrated by a real server of the installed Prefect; each
server then runs its own start-up (migration check, block registration) on it as usual.

The session's template folder is named by ``DATAGEN_TESTS_PREFECT_DB`` (set by the first pytest process,
inherited by the xdist workers and by every process a test starts). The xdist controller starts building it
in the background (:func:`start_building`) while the workers start; a process that needs it first waits for
the build under a file lock (:func:`template_db`), or builds it itself.

    python -m tests.support.prefect_db FOLDER   (build the template in FOLDER; what start_building runs)
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

TEMPLATE_ENV = "DATAGEN_TESTS_PREFECT_DB"
DB_NAME = "prefect.db"
READY = "ready"
REPO = Path(__file__).resolve().parents[2]


def session_folder() -> Path:
    """The session's template folder, chosen (and exported to child processes) on first use."""
    folder = os.environ.get(TEMPLATE_ENV)
    if not folder:
        folder = tempfile.mkdtemp(prefix="datagen-tests-prefect-db-")
        os.environ[TEMPLATE_ENV] = folder
    return Path(folder)


def start_building() -> subprocess.Popen[bytes]:
    """Build the session's template in a background process (it takes the lock before anyone can ask)."""
    return _build_process(session_folder(), locked=True)


def _build_process(folder: Path, *, locked: bool) -> subprocess.Popen[bytes]:
    """``python -m tests.support.prefect_db [--unlocked] FOLDER``: the build, in a process of its own.

    Its own process, because the build points ``PREFECT_HOME`` at the template's home; ``locked``: it takes the
    lock itself (the background build), else the caller holds it.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [
        sys.executable,
        "-m",
        "tests.support.prefect_db",
        *([] if locked else ["--unlocked"]),
        str(folder),
    ]
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "build.log").open("ab") as log:
        return subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
        )


def _build(folder: Path) -> None:
    """Start the CLI's temporary API server on an empty home in ``folder``, wait for it, stop it.

    Runs in a process of its own (:func:`_build_process`): it changes its process's environment.
    """
    from flows.api_server import LocalApiServer

    home = folder / "home"
    home.mkdir(parents=True, exist_ok=True)
    os.environ["PREFECT_HOME"] = str(home)
    for name in (
        "PREFECT_API_URL",
        "PREFECT_SERVER_DATABASE_CONNECTION_URL",
        "PREFECT_API_DATABASE_CONNECTION_URL",
    ):
        os.environ.pop(name, None)
    server = LocalApiServer(folder / "server.log")
    server.spawn(with_settings=False)
    try:
        server.start()
    finally:
        server.stop()
    # SQLite's backup copies what the write-ahead log still holds too: a plain copy of the file would miss it.
    template = folder / DB_NAME
    with sqlite3.connect(home / DB_NAME) as source, sqlite3.connect(template) as copy:
        source.backup(copy)
    (folder / READY).write_text(str(template))


def template_db() -> Path:
    """The migrated template database of this session, built here unless another process has built it.

    Raises:
        RuntimeError: The build failed (the message quotes its server log).
    """
    folder = session_folder()
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # waits while the background build holds it
        if not (folder / READY).exists():
            _build_process(folder, locked=False).wait()
        if not (folder / READY).exists():
            logs = [folder / "build.log", folder / "server.log"]
            tail = "".join(log.read_text(errors="replace")[-2000:] for log in logs if log.exists())
            raise RuntimeError(f"building the template Prefect database failed:\n{tail}")
    return Path((folder / READY).read_text())


def seed_prefect_home(home: Path, db_name: str = DB_NAME) -> Path:
    """Put a copy of the migrated template database into ``home`` (unless it has one); returns the home.

    Args:
        home: A Prefect home (``PREFECT_HOME``) or any folder a server's database goes into.
        db_name: The database file's name there (Prefect's default ``prefect.db``).

    """
    target = home / db_name
    if not target.exists():
        home.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template_db(), target)
    return home


if __name__ == "__main__":
    if sys.argv[1] == "--unlocked":
        _build(Path(sys.argv[2]))
    else:
        os.environ[TEMPLATE_ENV] = sys.argv[1]
        template_db()
