"""flows.task_runner's caches (settings serialized once in the driver, validated once in a worker)
and flows.iteration.without_flow_heartbeats, without Ray (the Ray path: tests/integration/test_task_runner.py)."""

from __future__ import annotations


def test_settings_are_serialized_once_per_settings_object():
    from prefect.context import SettingsContext
    from prefect.settings import PREFECT_FLOWS_DEFAULT_RETRIES, temporary_settings

    from flows.task_runner import _OnceSerializedSettings

    cur = SettingsContext.get()
    a = _OnceSerializedSettings(profile=cur.profile, settings=cur.settings)
    b = _OnceSerializedSettings(profile=cur.profile, settings=cur.settings)
    assert a.serialize() is b.serialize()  # one dict for one settings object
    assert a.serialize() == SettingsContext.serialize(cur)
    with temporary_settings(updates={PREFECT_FLOWS_DEFAULT_RETRIES: 7}):
        new = SettingsContext.get()
        c = _OnceSerializedSettings(profile=new.profile, settings=new.settings)
        assert c.serialize()["settings"]["flows"]["default_retries"] == 7  # new settings, new dict
    assert a.serialize(include_secrets=False) == SettingsContext.serialize(cur, include_secrets=False)


def test_worker_settings_are_validated_once_per_serialized_dict():
    from prefect.context import SettingsContext
    from prefect.settings import PREFECT_FLOWS_DEFAULT_RETRIES, temporary_settings

    from flows.task_runner import _settings_context

    base = SettingsContext.get().serialize()
    with temporary_settings(updates={PREFECT_FLOWS_DEFAULT_RETRIES: 4}):
        other = SettingsContext.get().serialize()
    one, two = _settings_context(base), _settings_context(dict(base))
    assert one is not two and one.settings is two.settings  # fresh contexts, one validated model
    changed = _settings_context(other)
    assert changed.settings.flows.default_retries == 4
    assert changed.settings is not one.settings
    with changed:
        from prefect.settings import get_current_settings

        assert get_current_settings().flows.default_retries == 4


def test_iteration_subflows_run_without_their_own_heartbeat():
    from prefect.settings import get_current_settings

    from flows.iteration import without_flow_heartbeats

    before = get_current_settings()
    assert before.flows.heartbeat_frequency is not None  # Prefect's default: 180 s
    with without_flow_heartbeats():
        inside = get_current_settings()
        assert inside.flows.heartbeat_frequency is None
        assert inside.api.url == before.api.url  # nothing else changes
    with without_flow_heartbeats():
        assert get_current_settings() is inside  # the copy is built once per base settings
    assert get_current_settings() is before


def test_the_heartbeat_free_copy_does_not_reread_the_environment(monkeypatch):
    """Prefect's copy_with_update re-validates and picks up a PREFECT_API_URL exported after the base
    settings were built; the subflows' copy must keep the parent's API."""
    from prefect.context import SettingsContext, get_settings_context
    from prefect.settings import Settings, get_current_settings

    from flows.iteration import without_flow_heartbeats

    ctx = get_settings_context()
    # a base built from the environment without PREFECT_API_URL (not the ambient settings, which an
    # earlier test may have given an explicit API URL), as the CLI's settings are before it starts a server
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    base = Settings()
    assert base.api.url is None and base.flows.heartbeat_frequency is not None
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    assert base.copy_with_update().api.url == "http://127.0.0.1:9/api"  # what a re-validating copy does
    with SettingsContext(profile=ctx.profile, settings=base), without_flow_heartbeats():
        inside = get_current_settings()
        assert inside.flows.heartbeat_frequency is None
        assert inside.api.url == base.api.url != "http://127.0.0.1:9/api"
        assert inside.model_dump(exclude={"flows"}) == base.model_dump(exclude={"flows"})
        assert inside.flows.model_dump(exclude={"heartbeat_frequency"}) == base.flows.model_dump(
            exclude={"heartbeat_frequency"})
