"""Prefect automations of ``deployments/automations.yaml``: read, validate, create (``hybridflow deploy``).

An automation with the same name is replaced, so deploying twice leaves one of each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DEFAULT_AUTOMATIONS_YAML = "deployments/automations.yaml"


class AutomationError(RuntimeError):
    """A problem already phrased for the user (one line)."""


def load_automations(path: Path) -> list[Any]:
    """The file's ``automations`` as Prefect ``AutomationCore`` objects; AutomationError naming
    the file and the entry when one does not validate."""
    import yaml
    from prefect.events.schemas.automations import AutomationCore
    from pydantic import ValidationError

    if not path.is_file():
        raise AutomationError(f"no automations file at {path}")
    spec = yaml.safe_load(path.read_text()) or {}
    entries = spec.get("automations") if isinstance(spec, dict) else None
    if not isinstance(entries, list) or not entries:
        raise AutomationError(f"{path}: 'automations' must be a non-empty list")
    out = []
    for i, entry in enumerate(entries):
        try:
            out.append(AutomationCore.model_validate(entry))
        except ValidationError as e:
            name = entry.get("name") if isinstance(entry, dict) else None
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise AutomationError(f"{path}: automation {name or i!r}: {where}: {first['msg']}") from None
    return out


def create_automations(api: str, path: Path) -> list[tuple[str, str]]:
    """Create the automations of ``path`` on the Prefect API ``api`` (replacing same-named ones);
    returns (name, id) per automation."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    automations = load_automations(path)
    created = []
    with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        for automation in automations:
            for old in client.read_automations_by_name(automation.name):
                client.delete_automation(old.id)
            created.append((automation.name, str(client.create_automation(automation))))
    return created
