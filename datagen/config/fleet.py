"""The fleet (``fleet:``): engine, servers, SGLang knobs, router; read by the host stage's planner."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from datagen.config.base import StrictModel
from datagen.config.ui_json import UI_MAPPING, UI_OPTIONAL_MAPPING, UNWRAP_UI_JSON

EngineKind = Literal["transformers", "sglang", "external"]
RouterPolicy = Literal["random", "round_robin", "power_of_two", "cache_aware"]


class SGLangOptions(StrictModel):
    """SGLang-only launch knobs; the planner fills what is left unset from the probed host."""

    attention_backend: str | None = Field(default=None, description="e.g. fa3, flashinfer; auto by SM.")
    mem_fraction_static: float | None = Field(default=None, gt=0, lt=1)
    max_running_requests: int | None = Field(default=None, gt=0)
    mamba_cache_strategy: Literal["auto", "no_buffer", "extra_buffer", "extra_buffer_lazy"] | None = Field(
        default=None,
        description="Hybrid models' state cache strategy; the flag name is detected from the installed sglang.",
    )
    disable_radix_cache: bool = Field(
        default=True,
        description="Unique prompts share no prefix; disabling the radix cache raises concurrency.",
    )
    reasoning_parser: str | None = Field(default="qwen3")
    tool_call_parser: str | None = Field(default=None)
    speculative: Annotated[dict[str, Any] | None, UNWRAP_UI_JSON, UI_OPTIONAL_MAPPING] = Field(
        default=None,
        description="Speculative decoding flags without leading dashes, e.g. {algorithm: EAGLE}.",
    )


class FleetConfig(StrictModel):
    """How many servers, of which engine, where, and how hard the dispatcher may drive each one."""

    engine: EngineKind = "transformers"
    num_servers: int | None = Field(
        default=None, gt=0, description="Servers to start; one per GPU when unset (cpu_servers without GPUs)."
    )
    cpu_servers: int = Field(default=2, gt=0, description="Servers to start on a host without GPUs.")
    tensor_parallel: int | None = Field(
        default=None, gt=0, description="GPUs per server; the planner decides when unset."
    )
    host: str = "127.0.0.1"
    base_port: int = Field(default=30000, gt=1023, lt=65000)
    external_urls: list[str] = Field(
        default_factory=list, description="Base URLs of servers already running (engine: external)."
    )
    max_inflight_per_server: int = Field(
        default=64, gt=0, description="Requests the dispatcher keeps in flight on each server."
    )
    ready_timeout_s: float = Field(default=900.0, gt=0)
    max_restarts_per_server: int = Field(default=3, ge=0)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    extra_args: list[str] = Field(default_factory=list, description="Appended verbatim to every server argv.")
    # Mapping fields carry an explicit default (pydantic copies it per instance) so the UI's form shows one.
    env: Annotated[dict[str, str], UNWRAP_UI_JSON, UI_MAPPING] = Field(
        default={}, description="Extra environment for the servers."
    )
    sglang: SGLangOptions = Field(default_factory=SGLangOptions)
    speculative: Literal["off", "mtp"] = Field(
        default="off",
        description="Speculative decoding: `mtp` runs the model's built-in MTP layers as the drafter (sglang; "
        "the recipe of the model family, refused for models without MTP layers). Distribution-preserving at "
        "temperature > 0 (rejection sampling); keep min_p unset.",
    )
    tune_result: str | None = Field(
        default=None,
        description="A `datagen tune --output FILE` result (JSON): its best in-flight count per server (and "
        "max running requests for sglang) replace the planned ones.",
    )
    fix_jit_env: bool = Field(
        default=False,
        description="Add the CUDA include/stub paths the probe found (CPATH, LIBRARY_PATH, CUDA_HOME) to the "
        "servers' environment so JIT kernel builds find CCCL headers and libcuda stubs; never the flow's.",
    )
    router: bool = Field(
        default=False,
        description="Start sglang-router in front of the servers; the dispatcher then talks to it only.",
    )
    router_policy: RouterPolicy = Field(default="cache_aware", description="sglang-router --policy.")
    router_port: int | None = Field(
        default=None, gt=1023, lt=65536, description="Router port; the first free port after the servers'."
    )

    @model_validator(mode="after")
    def _external_needs_urls(self) -> FleetConfig:
        if self.engine == "external" and not self.external_urls:
            raise ValueError("engine 'external' needs fleet.external_urls: the base URLs of running servers")
        if self.speculative == "mtp" and self.engine != "sglang":
            raise ValueError(
                f"fleet.speculative: mtp needs engine sglang (engine is {self.engine}); set it to off or switch engine"
            )
        if self.speculative == "mtp" and self.sglang.speculative:
            raise ValueError(
                "fleet.speculative: mtp and fleet.sglang.speculative both set speculative flags: keep one"
            )
        return self
