"""The application layer: what composes the stages for a user.

Owns the ``datagen`` command (:mod:`cli`), the checks before training is halted (:mod:`preflight`), how a run's
parameters or a config file become its config (:mod:`run_request`), running the flow in a terminal and printing
its summary (:mod:`terminal`), waiting on a deployed run (:mod:`wait`), the local demo (:mod:`demo`), deploying
(:mod:`deploy`, :mod:`pullstep`, :mod:`codeversion`), measuring a fleet's best in-flight caps (:mod:`tune`), the
configuration reference generator (:mod:`configdoc`) and the tiny test model (:mod:`tinymodel`).

May import: every stage of :mod:`datagen`; never :mod:`flows` or :mod:`tasks` (the flow is passed in).
"""

__all__ = [
    "cli",
    "codeversion",
    "configdoc",
    "demo",
    "deploy",
    "preflight",
    "pullstep",
    "run_request",
    "terminal",
    "tinymodel",
    "tune",
    "wait",
]
