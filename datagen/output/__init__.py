"""Output: every byte a run writes, write-once, and what is built from it.

Owns the write-once store (:mod:`store`, with :mod:`local` and :mod:`s3` backends and :mod:`s3_client`
for endpoint and credentials), every object key (:mod:`layout`), run identity (:mod:`runs`), the manifest
written last (:mod:`manifest`), merge-and-tokenize into Parquet and dataset versions (:mod:`merge`; rows and
masks in :mod:`tokenize`; the one tokenizer loader and template render in :mod:`tokenizer`; the version
manifests and their write-once claim in :mod:`versions`; the trainers' export in :mod:`export`; an existing
corpus adopted in :mod:`corpus`) and the run report (:mod:`report`).

May import: the shared top level (config, settings, errors, records) only; every stage writes through it.
"""

__all__ = [
    "corpus",
    "export",
    "layout",
    "local",
    "manifest",
    "merge",
    "report",
    "runs",
    "s3",
    "s3_client",
    "store",
    "tokenize",
    "tokenizer",
    "versions",
]
