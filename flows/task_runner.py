"""The iteration's task runner: prefect-ray's ``RayTaskRunner``, or Prefect's thread pool.

:class:`RayNodeTaskRunner` is ``prefect_ray.RayTaskRunner`` (prefect-ray 0.6, prefect 3.9, both
pinned) without three per-task costs that made up most of a node task's fixed cost (py-spy and
cProfile, session 11; docs/benchmarks.md#overhead):

- In the Ray worker, the Prefect settings each task carries (a plain dict from
  ``prefect.context.serialize_context``) were validated into a new ``Settings`` for every task
  (``prefect.context.hydrated_context``): pydantic-settings re-reads the environment, ``.env``
  files and the profiles file for each nested model, ~40 ms a task. The same dict gives the same
  settings, so the worker keeps the last one it built and enters it itself; a task with other
  settings (another Prefect server, another profile) builds its own.
- In the Ray worker, ``hydrated_context`` and the task engine each opened a Prefect client per
  task (~25 ms each, most of it loading the CA bundle into an SSL context, plus a new
  connection). The worker keeps one open client per API URL and makes it current for each task.
- In the driver, the same settings were serialized again for every task submitted (~0.1 s of
  CPU each, walking every settings field for secrets): :meth:`RayNodeTaskRunner.submit`
  serializes them once per settings object.

Everything else (scheduling, upstream futures, the task engine, retries, states) is prefect-ray's.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefect.context import SettingsContext, SyncClientContext
from prefect_ray import RayTaskRunner

_SETTINGS: dict[str, Any] = {}  # in a Ray worker: {serialized settings: SettingsContext built from it}
_CLIENTS: dict[str, Any] = {}  # in a Ray worker: {Prefect API URL: SyncClientContext opened once}
_SERIALIZED: list[Any] = []  # in the driver: [(settings object, its serialize() dict)]


def _serialized_once(settings_context: Any) -> dict[str, Any]:
    """``settings_context.serialize()``, computed once per Settings object (they are immutable:
    a change of settings is a new object)."""
    if not _SERIALIZED or _SERIALIZED[0][0] is not settings_context.settings:
        _SERIALIZED[:] = [(settings_context.settings, SettingsContext.serialize(settings_context))]
    return _SERIALIZED[0][1]


def _settings_context(serialized: dict[str, Any]) -> Any:
    """The SettingsContext for ``serialized`` (``serialize_context()["settings_context"]``), built
    once per worker process for the same dict (the last one is kept)."""
    key = json.dumps(serialized, sort_keys=True, default=str)
    built = _SETTINGS.get(key)
    if built is None:
        built = SettingsContext(**serialized)
        _SETTINGS.clear()
        _SETTINGS[key] = built
    return SettingsContext(profile=built.profile, settings=built.settings)  # a fresh context, validated models


@contextmanager
def _worker_client() -> Iterator[None]:
    """Make this process's Prefect client for the current API URL the current one (opened on first
    use and kept open). Prefect's ``get_client(sync_client=True)`` and
    ``SyncClientContext.get_or_create()`` return the current context's client. Without an API URL
    (an ephemeral server) a client is opened for the call, as Prefect would."""
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    if not api:
        with SyncClientContext():
            yield
        return
    ctx = _CLIENTS.get(api)
    if ctx is None:
        ctx = SyncClientContext()
        # open it (and check the API version once) in a throwaway context: it becomes current
        # only inside each call, below, never for the rest of the process
        contextvars.copy_context().run(ctx.__enter__)
        _CLIENTS[api] = ctx
    token = SyncClientContext.__var__.set(ctx)
    try:
        yield
    finally:
        SyncClientContext.__var__.reset(token)


class _OnceSerializedSettings(SettingsContext):
    """The current SettingsContext, whose ``serialize()`` is computed once per Settings object."""

    def serialize(self, include_secrets: bool = True) -> dict[str, Any]:
        if not include_secrets:
            return super().serialize(include_secrets=False)
        return _serialized_once(self)


class RayNodeTaskRunner(RayTaskRunner):
    """``prefect_ray.RayTaskRunner`` whose driver serializes the Prefect settings once and whose
    workers reuse the settings and the client of the previous task when they are the same (see
    the module docstring). Same arguments as ``RayTaskRunner``."""

    def submit(self, task: Any, parameters: dict[str, Any], wait_for: Any = None, dependencies: Any = None) -> Any:
        """``RayTaskRunner.submit``, with the current settings serialized once (see the module docstring)."""
        current = SettingsContext.get()
        if current is None:
            return super().submit(task, parameters, wait_for=wait_for, dependencies=dependencies)
        with _OnceSerializedSettings(profile=current.profile, settings=current.settings):
            return super().submit(task, parameters, wait_for=wait_for, dependencies=dependencies)

    @staticmethod
    def _run_prefect_task(*upstream_ray_obj_refs: Any, task: Any, task_run_id: Any, context: dict[str, Any],
                          parameters: dict[str, Any], wait_for: Any = None, dependencies: Any = None) -> Any:
        kwargs = dict(task=task, task_run_id=task_run_id, parameters=parameters, wait_for=wait_for,
                      dependencies=dependencies)
        serialized = context.get("settings_context")
        if not serialized:
            return RayTaskRunner._run_prefect_task(*upstream_ray_obj_refs, context=context, **kwargs)
        rest = {k: v for k, v in context.items() if k != "settings_context"}
        # hydrated_context then uses the current settings, and it and the task engine both take the
        # client of the current SyncClientContext instead of building one each
        with _settings_context(serialized), _worker_client():
            return RayTaskRunner._run_prefect_task(*upstream_ray_obj_refs, context=rest, **kwargs)
