"""Prefect tasks: one per dataflow node; thin glue that calls a pool and returns BatchRefs."""
