"""The application layer: what composes the stages for a user.

Owns the ``datagen`` command (:mod:`cli`), the checks before training is halted (:mod:`preflight`), the
runner that executes the flow and prints its summary (:mod:`runner`), the local demo (:mod:`demo`), the
configuration reference generator (:mod:`configdoc`) and the tiny test model (:mod:`tinymodel`).

May import: every stage of :mod:`datagen`; never :mod:`flows` or :mod:`tasks` (the flow is passed in).
"""

__all__ = ["cli", "configdoc", "demo", "preflight", "runner", "tinymodel"]
