"""Prefect tasks: thin wrappers adding retries, cache keys, names, logs and artifacts around core calls."""
