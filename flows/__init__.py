"""Prefect flows: the RL iteration, training, evaluation, and the declarative dataflow API."""
