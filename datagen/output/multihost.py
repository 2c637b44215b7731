"""The multi-host handshake: write-once objects through which a run's parent and its host parts talk.

One parent attempt (the `expand` flow) and one host part per box (the `expand-host` flow, on that box's
worker) share nothing but the run's store and the Prefect API. Per parent attempt, under
``runs/<run_id>/hosts/<attempt>/`` (keys in :class:`datagen.output.layout.RunLayout.hosts_object`)::

    started.json            parent -> hosts  the host parts the parent started (host -> flow run id)
    <host>/preflight.json   host -> parent   the host's own checks passed (or their problems)
    go.json                 parent -> hosts  every host passed: halt training and serve (or: stop, why)
    <host>/fleet.json       host -> parent   the host's servers are ready: their URLs and in-flight cap
    <host>/fleet-NNNN.json  host -> parent   version N: a server restarted (maybe on another port)
    release.json            parent -> hosts  generation is over: stop the servers, hand the GPUs back

Every object is created once (a second writer gets ``OutputExistsError``); a reader polls for it. So
no host halts its training before every host's preflight passed, and a host keeps its servers until the
parent says so, however the two processes are scheduled. A change of a host's servers is a new object, never
an overwrite: each restart publishes the next version of its fleet (:class:`FleetPublisher`), which the parent
reads in order (:func:`read_host_fleet`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from datagen.output.layout import RunLayout
from datagen.output.store import Store
from datagen.records import utc_now

logger = logging.getLogger(__name__)


class HostObject(BaseModel):
    """One kind of handshake object; each kind owns its object name, so no caller pairs a name with a model."""

    model_config = ConfigDict(extra="forbid")

    object_name: ClassVar[str]


ObjectT = TypeVar("ObjectT", bound=HostObject)


class HostPreflight(HostObject):
    """A host part's checks, run on its box before anything there is halted."""

    object_name = "preflight.json"

    host: str
    flow_run_id: str
    hostname: str = Field(description="The machine the host part runs on (its `socket.gethostname()`).")
    problems: list[str] = Field(default_factory=list, description="Empty when every check passed.")


class HostsStarted(HostObject):
    """The host parts the parent started for this attempt: a host part serves only a parent that lists it."""

    object_name = "started.json"

    parent_flow_run_id: str
    flow_runs: dict[str, str] = Field(description="Host name -> the flow run id of its host part.")


class HostsGo(HostObject):
    """The parent's decision once every host reported its preflight."""

    object_name = "go.json"

    go: bool
    reason: str = ""


class HostFleet(HostObject):
    """A host's ready servers, as the parent's dispatcher needs them."""

    object_name = "fleet.json"

    host: str
    flow_run_id: str
    hostname: str
    pid: int = Field(description="The host part's process (it owns the servers).")
    urls: list[str] = Field(min_length=1, description="Base URLs the dispatcher sends requests to.")
    max_inflight_per_server: int = Field(gt=0, description="The host's planned in-flight cap per URL.")
    served_model_name: str
    created_at: str = Field(default_factory=lambda: utc_now().isoformat())
    launched: bool = Field(
        default=True,
        description="The host launched these servers: it restarts them and vouches for each restart (False: "
        "external servers, which the parent probes itself).",
    )
    version: int = Field(
        default=0, ge=0, description="0 in fleet.json; each restart of a server publishes the next version."
    )
    restarted: list[str] = Field(
        default_factory=list,
        description="URLs restarted since the version before, each checked by the host as its own server.",
    )

    @property
    def name(self) -> str:
        """The object name of this version: ``fleet.json``, then ``fleet-0001.json``, ``fleet-0002.json``..."""
        return fleet_object_name(self.version)


def fleet_object_name(version: int) -> str:
    """The object name of version ``version`` of a host's fleet."""
    return HostFleet.object_name if version == 0 else f"fleet-{version:04d}.json"


class HostsRelease(HostObject):
    """Generation is over: hosts stop their servers."""

    object_name = "release.json"

    reason: str
    lost_hosts: dict[str, str] = Field(
        default_factory=dict, description="Hosts lost during the attempt -> what happened to each."
    )


def write_host_object(
    store: Store, layout: RunLayout, attempt_id: str, value: HostObject, host: str | None = None
) -> str:
    """Create one handshake object (write-once, under its kind's name); returns its URL."""
    return store.write_json(layout.hosts_object(attempt_id, value.object_name, host), value).url


def read_host_fleet(
    store: Store, layout: RunLayout, attempt_id: str, host: str, version: int
) -> HostFleet | None:
    """Version ``version`` of a host's fleet if it exists yet, else None."""
    key = layout.hosts_object(attempt_id, fleet_object_name(version), host)
    if not store.exists(key):
        return None
    return HostFleet.model_validate(store.read_json(key))


def read_latest_host_fleet(store: Store, layout: RunLayout, attempt_id: str, host: str) -> HostFleet | None:
    """A host's fleet as its latest version has it (None before ``fleet.json`` exists).

    A host joining late may have restarted a server already: joining with ``fleet.json`` alone would send
    requests to a port its server has left.
    """
    latest = read_host_fleet(store, layout, attempt_id, host, 0)
    while latest is not None:
        newer = read_host_fleet(store, layout, attempt_id, host, latest.version + 1)
        if newer is None:
            break
        latest = newer
    return latest


class FleetPublisher:
    """A host part's fleet in the store: ``fleet.json`` first, then one new version per server restart.

    Connect :meth:`server_restarted` to :meth:`datagen.host.fleet.Fleet.on_server_restarted`. Each version
    holds every URL (plan order) with the restarted one in place, so the parent replaces a moved server's URL
    by position and trusts a restarted server again only from that version on.

    Args:
        store: The run's store.
        layout: The run's keys.
        attempt_id: The parent attempt (its handshake folder).
        first: The host's servers as they are ready now (version 0).
    """

    def __init__(self, store: Store, layout: RunLayout, attempt_id: str, first: HostFleet) -> None:
        self.store = store
        self.layout = layout
        self.attempt_id = attempt_id
        self.latest = first
        # What the next version holds: every URL as it is now, and the restarts no version published yet (a
        # write that failed leaves them here for the next one).
        self._urls = list(first.urls)
        self._unpublished: list[str] = []
        self._lock = threading.Lock()

    def publish(self) -> str:
        """Write the first version (``fleet.json``); returns its URL."""
        return self._write(self.latest)

    def server_restarted(self, old_url: str, new_url: str) -> None:
        """Publish the next version: ``old_url`` replaced by ``new_url`` (the same when it did not move)."""
        with self._lock:
            self._urls = [new_url if url == old_url else url for url in self._urls]
            self._unpublished = [url for url in self._unpublished if url != old_url] + [new_url]
            following = self.latest.model_copy(
                update={
                    "version": self.latest.version + 1,
                    "urls": list(self._urls),
                    "restarted": list(dict.fromkeys(self._unpublished)),
                    "created_at": utc_now().isoformat(),
                }
            )
            self._write(following)
            self.latest = following
            self._unpublished = []
        logger.info(
            "published fleet version host=%s version=%d restarted=%s moved_from=%s",
            following.host,
            following.version,
            new_url,
            old_url if old_url != new_url else "-",
        )

    def _write(self, fleet: HostFleet) -> str:
        key = self.layout.hosts_object(self.attempt_id, fleet.name, fleet.host)
        return self.store.write_json(key, fleet).url


def read_host_object(
    store: Store, layout: RunLayout, attempt_id: str, model: type[ObjectT], host: str | None = None
) -> ObjectT | None:
    """The handshake object of kind ``model`` if it exists yet, else None."""
    key = layout.hosts_object(attempt_id, model.object_name, host)
    if not store.exists(key):
        return None
    return model.model_validate(store.read_json(key))


def wait_for_host_object(
    store: Store,
    layout: RunLayout,
    attempt_id: str,
    model: type[ObjectT],
    *,
    host: str | None = None,
    poll_s: float,
    timeout_s: float | None = None,
    give_up: Callable[[], str | None] = lambda: None,
) -> ObjectT | str:
    """Poll until the object exists, ``give_up`` returns a reason, or ``timeout_s`` passes.

    Returns:
        The object, or why the wait ended without it.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        found = read_host_object(store, layout, attempt_id, model, host)
        if found is not None:
            return found
        reason = give_up()
        if reason:
            return reason
        if deadline is not None and time.monotonic() >= deadline:
            return f"{layout.hosts_object(attempt_id, model.object_name, host)} did not appear within {timeout_s:.0f}s"
        time.sleep(poll_s)
