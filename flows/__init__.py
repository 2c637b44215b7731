"""Prefect flows: the DAG only; every stage's work lives in the Prefect-free ``datagen`` package."""
