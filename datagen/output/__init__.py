"""Output: every byte a run writes, write-once, and what is built from it.

Owns the write-once store (:mod:`store`, with :mod:`local` and :mod:`s3` backends and :mod:`s3_client`
for endpoint and credentials), every object key (:mod:`layout`), run identity (:mod:`runs`), the manifest
written last (:mod:`manifest`), merge-and-tokenize into Parquet and dataset versions (:mod:`merge`,
:mod:`tokenize`) and the run report (:mod:`report`).

May import: the shared top level (config, settings, errors, records) only; every stage writes through it.
"""

__all__ = ["layout", "local", "manifest", "merge", "report", "runs", "s3", "s3_client", "store", "tokenize"]
