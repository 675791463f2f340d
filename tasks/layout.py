"""The names of the run-folder files the tasks write (no heavy imports: flows.run_dir, which
names the rest of the layout, imports these before any server or model)."""

EXECUTION_LOG = "execution_log.jsonl"  # one line per node body that ran (tasks.common.record_execution)
RESULTS = "prefect-results"  # Prefect's result storage: the node-level cache (tasks.results)


def ledger_name(role: str) -> str:
    """``updates_<role>.jsonl``: the exactly-once ledger of a trained role (tasks.versions)."""
    return f"updates_{role}.jsonl"
