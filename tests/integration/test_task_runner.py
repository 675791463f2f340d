"""flows.task_runner.RayNodeTaskRunner on a real local Ray and Prefect server: node tasks see the
driver's settings (also after they change), run nested under their flow run, and the worker reuses
the settings it built for the same serialized dict."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("ray_cluster")


def _flow():
    from prefect import flow, task

    from flows.task_runner import RayNodeTaskRunner

    @task
    def probe(x: int) -> dict:
        import os

        from prefect.client.orchestration import get_client
        from prefect.context import SettingsContext
        from prefect.settings import get_current_settings

        from flows import task_runner

        s = get_current_settings()
        return {"x": x, "pid": os.getpid(), "retries": s.flows.default_retries, "api": s.api.url,
                "settings_id": id(SettingsContext.get().settings), "cached": len(task_runner._SETTINGS),
                "client_id": id(get_client(sync_client=True)), "clients": len(task_runner._CLIENTS)}

    @flow(task_runner=RayNodeTaskRunner(), persist_result=False)
    def chain() -> list[dict]:
        from prefect_ray.context import remote_options

        with remote_options(num_cpus=0):
            a = probe.submit(1)
            b = probe.submit(a.result()["x"] + 1)  # a second task in the (usually same) worker
            return [a.result(), b.result()]

    return chain


def test_node_tasks_get_the_drivers_settings_and_their_changes(prefect_api):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_FLOWS_DEFAULT_RETRIES, temporary_settings

    chain = _flow()
    with temporary_settings(updates={PREFECT_FLOWS_DEFAULT_RETRIES: 3}):
        state = chain(return_state=True)
        first = state.result()
    with temporary_settings(updates={PREFECT_FLOWS_DEFAULT_RETRIES: 5}):
        second = chain()
    assert [r["retries"] for r in first] == [3, 3]
    assert [r["retries"] for r in second] == [5, 5]  # a changed setting reaches the worker
    assert all(r["api"] == prefect_api for r in first + second)
    assert all(r["cached"] == 1 for r in first + second)  # one settings object kept per worker
    same_worker = [r for r in first if r["pid"] == first[0]["pid"]]
    assert all(r["clients"] == 1 for r in first + second)  # one client per API URL per worker
    if len(same_worker) == 2:  # the same dict gives the same validated settings in one worker, one client
        assert same_worker[0]["settings_id"] == same_worker[1]["settings_id"]
        assert same_worker[0]["client_id"] == same_worker[1]["client_id"]
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    assert sorted(r.state.type.value for r in runs) == ["COMPLETED", "COMPLETED"]  # nested under the flow run
