"""The chaos soak's services: the integration tests' Prefect server and local Ray (one each for the
session, started and stopped by tests/integration/conftest.py's fixtures, reused here)."""

from tests.integration.conftest import prefect_api, ray_cluster  # noqa: F401 - fixtures
