"""The GPU host: what it offers, how its servers are planned and run, and the training job that shares it.

Owns probing the environment (:mod:`probe`; ``nvidia-smi`` run and parsed in :mod:`nvidia_smi`, CUDA and
torch in :mod:`cuda_env`, the report model in :mod:`env_report`, its problems and fixes in :mod:`diagnose`),
the server plan (:mod:`plan`: GPU groups in :mod:`gpu_groups`, ports and URLs in :mod:`ports`; model sizes,
server sizing, the in-flight cap and the ``datagen tune`` result it reads come from :mod:`datagen.engines`),
the one owner of server processes (:mod:`fleet`; one launch, its key file and log
in :mod:`server_process`) and its pidfile registry (:mod:`fleet_registry`), halting and restarting the
training job (:mod:`training`, :mod:`training_jobs`), the demo's stand-in trainer (:mod:`standin_trainer`)
and ``/proc`` process inspection and process-group teardown shared by all of them (:mod:`processes`).

May import: the shared top level (config, settings, errors, records), :mod:`datagen.engines`, :mod:`datagen.output`.
"""

__all__ = [
    "cuda_env",
    "diagnose",
    "env_report",
    "fleet",
    "fleet_registry",
    "gpu_groups",
    "nvidia_smi",
    "plan",
    "ports",
    "probe",
    "processes",
    "server_process",
    "standin_trainer",
    "training",
    "training_jobs",
]
