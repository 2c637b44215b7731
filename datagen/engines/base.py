"""The engine seam: what every generation engine must tell the planner and the fleet.

An engine is a *launch recipe*, not a process owner: it turns one planned server slot into an argv and an
environment, says where readiness is probed, and which log lines mean the server will never become ready.
The :class:`datagen.host.fleet.Fleet` owns the processes.
"""

from __future__ import annotations

import importlib.util
import re
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from typing import Any, Literal, NamedTuple, Protocol, Self, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from datagen.config import FleetConfig, ModelConfig, Share
from datagen.engines.model_size import ModelShape

DeviceKind = Literal["cpu", "cuda"]
ProblemSeverity = Literal["info", "warning", "error"]

# Log lines that mean a starting server could not bind its port (another program holds it): the fleet
# relaunches it on the next free port instead of failing.
BIND_FAILURE_LOG_PATTERNS: tuple[str, ...] = (
    r"[Aa]ddress already in use",
    r"error while attempting to bind on address",
    r"EADDRINUSE",
)
# Log lines that mean a starting server is dead or will never serve; shared by every engine.
COMMON_FATAL_LOG_PATTERNS: tuple[str, ...] = (
    r"^Traceback \(most recent call last\)",
    r"CUDA out of memory",
    r"torch\.OutOfMemoryError",
    *BIND_FAILURE_LOG_PATTERNS,
)


class LaunchCommand(BaseModel):
    """The exact process to start for one server: argv plus the environment added to the parent's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    argv: list[str] = Field(min_length=1, description="Program and arguments, no shell involved.")
    env: dict[str, str] = Field(default_factory=dict, description="Variables set on top of the parent env.")

    def shell_line(self) -> str:
        """The command as one shell-quoted line (env first), for artifacts and runbooks."""
        import shlex

        env_part = " ".join(f"{key}={shlex.quote(value)}" for key, value in sorted(self.env.items()))
        argv_part = shlex.join(self.argv)
        return f"{env_part} {argv_part}".strip()

    def shell_block(self) -> str:
        """The same command as shell lines: each variable and each option with its values on a line.

        For artifacts: Prefect's UI cuts a long line of a code block off, and a server's argv runs to hundreds
        of characters. The lines join with backslash continuations, so the block still pastes as one command.
        """
        import shlex

        program: list[list[str]] = []
        for arg in self.argv:
            if not program or arg.startswith("-"):
                program.append([arg])
            else:
                program[-1].append(arg)
        lines = [f"{key}={shlex.quote(value)}" for key, value in sorted(self.env.items())]
        lines += [shlex.join(group) for group in program]
        return " \\\n    ".join(lines)


class ServerSlot(BaseModel):
    """Where one server runs: the planner's decision that a recipe turns into a :class:`LaunchCommand`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0)
    host: str
    port: int = Field(gt=0, lt=65536)
    device: DeviceKind
    gpu_ids: list[int] = Field(default_factory=list, description="Physical GPU ids to pin")
    compute_capability: str | None = Field(default=None, description="SM of the slot's GPUs, e.g. '9.0'.")
    cpu_threads: int | None = Field(
        default=None, gt=0, description="Intra-op threads of a CPU server, so servers share the cores."
    )
    cache_memory_fraction: Share | None = Field(
        default=None,
        description="Share of the device's free memory for the KV cache; the engine default when unset.",
    )
    cache_num_blocks: int | None = Field(
        default=None, gt=0, description="KV cache size in blocks (sized by tokens instead of a memory share)."
    )
    max_batch_tokens: int | None = Field(default=None, gt=0, description="Tokens per forward step.")
    attention_backend: str | None = Field(default=None, description="Planned attention backend.")
    mem_fraction_static: float | None = Field(default=None, gt=0, lt=1, description="Planned static share.")
    max_running_requests: int | None = Field(default=None, gt=0, description="Planned concurrency cap.")
    context_length_tokens: int | None = Field(default=None, gt=0, description="Planned context length.")
    extra_env: dict[str, str] = Field(
        default_factory=dict, description="Planned variables (JIT fixes); fleet.env still wins."
    )
    cuda_graph_max_bs: int | None = Field(default=None, gt=0, description="Largest decode batch captured.")
    chunked_prefill_tokens: int | None = Field(default=None, gt=0, description="Tokens per prefill chunk.")
    disable_overlap_schedule: bool = Field(default=False, description="Required by some hybrid cache modes.")
    speculative_args: list[str] = Field(
        default_factory=list, description="Planned speculative-decoding flags (fleet.speculative recipe)."
    )


class EngineProblem(NamedTuple):
    """Something about this host that matters for one engine (the probe turns it into a report problem)."""

    severity: ProblemSeverity
    message: str
    fix: str | None


class CapacityRequest(BaseModel):
    """What the planner knows when it sizes one server: its GPUs, the model, the requests to expect."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    compute_capability: str | None = None
    gpu_memory_total_mib: int | None = Field(default=None, description="Smallest GPU of the server.")
    gpu_memory_in_use_mib: int = Field(default=0, ge=0, description="Held by others when probed (per GPU).")
    tensor_parallel: int = Field(default=1, ge=1)
    shape: ModelShape | None = None
    request_tokens: int = Field(gt=0, description="Prompt + answer tokens one request may occupy.")
    configured_inflight: int = Field(gt=0, description="fleet.max_inflight_per_server.")
    speculative: Literal["off", "mtp"] = "off"


class CapacityPlan(BaseModel):
    """An engine's sizing of one server: slot fields, the dispatcher's cap, and why."""

    model_config = ConfigDict(extra="forbid")

    slot_fields: dict[str, Any] = Field(default_factory=dict, description="ServerSlot fields to set.")
    max_inflight: int = Field(
        gt=0, description="The engine's in-flight cap; datagen.engines.capacity decides the one used."
    )
    inflight_reason: str = Field(default="", description="Why the engine's cap is what it is (one line).")
    reasons: list[str] = Field(default_factory=list)


@runtime_checkable
class Engine(Protocol):
    """A generation engine as a launch recipe (see module docstring)."""

    name: str
    """Engine kind as written in ``fleet.engine``."""
    health_path: str
    """HTTP path answering 200 once the server serves (readiness and liveness)."""
    models_path: str
    """HTTP path listing the served models (OpenAI's ``{"data": [{"id": ...}]}``): readiness checks the planned
    model is among them, so a server of another run or model is never used."""
    metrics_path: str | None
    """Prometheus metrics path; None when the engine has none (clients then measure themselves)."""
    unsupported_sampling_fields: frozenset[str]
    """Chat-completion sampling fields the engine refuses (422); the dispatcher leaves them out."""
    supports_generate: bool
    """Whether the engine serves SGLang's ``/generate`` (token ids in, token ids out): exact-token mode's default."""
    allows_exact_tokens: bool
    """Whether ``generation.exact_tokens: true`` may be set: the engine serves ``/generate``, or may (servers
    datagen did not start, e.g. SGLang behind a router); False refuses the setting."""
    fatal_log_patterns: tuple[re.Pattern[str], ...]
    """A match in a starting server's log means it will never become ready."""
    supports_tensor_parallel: bool
    """Whether one server may span several GPUs."""
    launches_processes: bool
    """False for engines that attach to servers someone else runs (no model directory or process here)."""
    launch_flags_vary: bool
    """Whether the launch flags differ between installs, so the probe records the ones this host's accepts."""
    packages: tuple[str, ...]
    """Distributions whose installed versions the probe reports for this engine."""

    def check_available(self) -> list[str]:
        """Problems that stop this engine from running here, each with its fix; empty when usable."""
        ...

    def build_launch(self, slot: ServerSlot, model: ModelConfig, fleet: FleetConfig) -> LaunchCommand:
        """The argv and env that start the server of ``slot``."""
        ...

    def served_model_name(self, model: ModelConfig) -> str:
        """The model name clients must send in requests to a server of this engine."""
        ...

    def api_key_args(self, key_file: str) -> list[str] | None:
        """Arguments that make a launched server require the API key stored in ``key_file``.

        The key itself never goes on the command line (``ps`` and the plan artifact show argvs).

        Returns:
            Arguments appended to the launch argv, or None when the engine cannot require a key.

        """
        ...

    def launch_on_port(self, launch: LaunchCommand, port: int) -> LaunchCommand:
        """``launch`` listening on ``port`` instead (a planned port another program took)."""
        ...

    def plan_capacity(self, request: CapacityRequest, fleet: FleetConfig) -> CapacityPlan:
        """Size one GPU server (memory share, concurrency, batch sizes) and the dispatcher's cap for it."""
        ...

    def host_problems(
        self, packages: Mapping[str, str | None], compute_capabilities: list[str]
    ) -> list[EngineProblem]:
        """What the probe should report about this engine on a host with these packages and GPUs."""
        ...


class EngineRecipe(ABC):
    """Defaults every engine shares; an engine overrides what it does differently.

    The defaults describe the plainest engine: it serves the OpenAI API only, on one device per server,
    needs nothing installed, reads no launch flags from its install, has no API key option, reports nothing
    about the host, and keeps ``fleet.max_inflight_per_server`` as its in-flight cap (``configured_cap_note``
    says why, in the plan). Every engine builds its own launch (:meth:`build_launch`).
    """

    name: str
    health_path = "/health"
    models_path = "/v1/models"
    port_flag = "--port"
    """The flag whose value is the port a launched server listens on."""
    metrics_path: str | None = None
    unsupported_sampling_fields: frozenset[str] = frozenset()
    supports_generate = False
    allows_exact_tokens = False
    fatal_log_patterns: tuple[re.Pattern[str], ...] = ()
    supports_tensor_parallel = False
    launches_processes = True
    launch_flags_vary = False
    packages: tuple[str, ...] = ()
    configured_cap_note = "fleet.max_inflight_per_server"
    """Why the configured cap stands, shown in the plan's in-flight reason."""

    @classmethod
    def for_installed(cls) -> Self:
        """The recipe for the engine installed here (an engine whose flags vary asks its install for them)."""
        return cls()

    @classmethod
    def for_flags(cls, flags: Collection[str] | None) -> Self:
        """The recipe for an install accepting launch ``flags`` (a probed host's); the same for every install."""
        return cls()

    @abstractmethod
    def build_launch(self, slot: ServerSlot, model: ModelConfig, fleet: FleetConfig) -> LaunchCommand:
        """The argv and env that start the server of ``slot``."""

    def launch_command(self, argv: list[str], slot: ServerSlot, fleet: FleetConfig) -> LaunchCommand:
        """``argv`` with the environment every launched server gets, later entries winning.

        The slot's GPU pinning (or hidden GPUs and thread caps on CPU), then the plan's variables (JIT
        fixes), then ``fleet.env``: the user's word is last.
        """
        return LaunchCommand(argv=argv, env={**gpu_env(slot), **slot.extra_env, **fleet.env})

    def check_available(self) -> list[str]:
        """Nothing to install."""
        return []

    def served_model_name(self, model: ModelConfig) -> str:
        """The configured served name, else the model path."""
        return model.served_name or model.path

    def api_key_args(self, key_file: str) -> list[str] | None:
        """No API key option: None."""
        return None

    def launch_on_port(self, launch: LaunchCommand, port: int) -> LaunchCommand:
        """``launch`` with the value of its last :attr:`port_flag` replaced by ``port``.

        Raises:
            ValueError: The argv has no such flag (the server cannot be moved to another port).

        """
        argv = list(launch.argv)
        positions = [index for index, arg in enumerate(argv[:-1]) if arg == self.port_flag]
        if not positions:
            raise ValueError(f"the launch command has no {self.port_flag} flag: {launch.shell_line()}")
        argv[positions[-1] + 1] = str(port)
        return launch.model_copy(update={"argv": argv})

    def plan_capacity(self, request: CapacityRequest, fleet: FleetConfig) -> CapacityPlan:
        """The engine sizes itself: the dispatcher keeps ``fleet.max_inflight_per_server``."""
        return CapacityPlan(
            max_inflight=request.configured_inflight,
            inflight_reason=f"in flight per server: {request.configured_inflight} ({self.configured_cap_note})",
        )

    def host_problems(
        self, packages: Mapping[str, str | None], compute_capabilities: list[str]
    ) -> list[EngineProblem]:
        """Nothing to report about the host."""
        return []


def module_importable(module: str) -> bool:
    """Whether ``module`` can be imported here, found without importing it (importing torch costs seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def compile_patterns(patterns: tuple[str, ...]) -> tuple[re.Pattern[str], ...]:
    """Compile log patterns in multi-line mode so ``^`` anchors at every line start."""
    return tuple(re.compile(pattern, re.MULTILINE) for pattern in patterns)


def compile_fatal_patterns(*engine_patterns: str) -> tuple[re.Pattern[str], ...]:
    """An engine's fatal log patterns: the ones every engine shares, then its own, compiled."""
    return compile_patterns((*COMMON_FATAL_LOG_PATTERNS, *engine_patterns))


def gpu_env(slot: ServerSlot) -> dict[str, str]:
    """Pin a server to its GPUs, or hide every GPU from a CPU server.

    Args:
        slot: The planned slot.

    Returns:
        ``CUDA_VISIBLE_DEVICES`` (and, for CPU servers, thread caps and a sleeping OpenMP wait policy).

    """
    if slot.device == "cpu":
        # OpenMP threads that finished their share of a step sleep instead of spinning for the next one: CPU
        # servers share the box with each other and with datagen itself, and a spinning thread burns a core
        # they need (benchmarks/bench_cpu_wait_policy.py; docs/performance.md, "Thresholds in the code").
        env = {"CUDA_VISIBLE_DEVICES": "", "OMP_WAIT_POLICY": "PASSIVE"}
        if slot.cpu_threads is not None:
            threads = str(slot.cpu_threads)
            env |= {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        return env
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(gpu) for gpu in slot.gpu_ids)}
