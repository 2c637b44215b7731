"""Output: every byte a run writes, write-once.

Owns the write-once store (:mod:`store`, with :mod:`local` and :mod:`s3` backends, :mod:`objects`, and
:mod:`s3_client` for endpoint and credentials), every object key (:mod:`layout`), run identity (:mod:`runs`),
the multi-host handshake objects (:mod:`multihost`) and the manifest written last (:mod:`manifest`). What is built
from the completions (merge, tokenize, dataset versions, export, report) is :mod:`datagen.dataset`.

May import: the shared top level (config, settings, errors, records) only; every stage writes through it.
"""

__all__ = ["hosts", "layout", "local", "manifest", "objects", "runs", "s3", "s3_client", "store"]
