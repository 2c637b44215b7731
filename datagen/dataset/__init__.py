"""The dataset a run produces: completions merged and tokenized into versioned training data, and the report.

Owns merge-and-tokenize (:mod:`merge`: completed shards into write-once Parquet parts, :mod:`parts`, in
tokenizer worker processes, :mod:`tokenize_workers`), the rows and their loss masks (:mod:`tokenize`), the one
tokenizer loader and prompt render (:mod:`tokenizer`; exact token ids in :mod:`tokenize_text`, tokenizer files
and chat templates without transformers in :mod:`tokenize_template`), the dataset version manifests and their
write-once claim (:mod:`versions`), the trainers' export (:mod:`export`), an existing corpus adopted as a base
version (:mod:`corpus`) and the run report (:mod:`report`). Every byte goes through :mod:`datagen.output`'s
write-once store.

May import: the shared top level (config, settings, errors, records) and :mod:`datagen.output`.
"""

__all__ = [
    "corpus",
    "export",
    "merge",
    "parts",
    "report",
    "tokenize",
    "tokenize_template",
    "tokenize_text",
    "tokenize_workers",
    "tokenizer",
    "versions",
]
