"""The Prefect result serializer of node results (kept apart from :mod:`tasks.types`, which
imports no Prefect: Prefect reads its settings once, when first imported)."""

from __future__ import annotations

import json
from typing import Any

from prefect.serializers import Serializer
from pydantic import Field

from tasks.results import SERIALIZER_TYPE
from tasks.types import NodeResult


class NodeResultSerializer(Serializer):
    """Prefect result serializer for node results: JSON of :meth:`NodeResult.to_json`, read back
    through :data:`RESULT_TYPES` only (no class is imported from what a file says)."""

    type: str = Field(default=SERIALIZER_TYPE, frozen=True)

    def dumps(self, obj: Any) -> bytes:
        if not isinstance(obj, NodeResult):
            raise TypeError(f"a node must return a NodeResult, got {type(obj).__name__}")
        return json.dumps(obj.to_json(), sort_keys=True).encode()

    def loads(self, blob: bytes) -> NodeResult:
        return NodeResult.from_json(json.loads(blob))


__all__ = ["NodeResultSerializer"]
