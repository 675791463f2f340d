"""The policy's side of weights for a separate rollout pool (asynchronous training, docs/async.md):
publish to Ray's object store, or broadcast through the weight-sync group
(:mod:`workers.weight_group`). Mixed into :class:`workers.policy.PolicyWorker`, which provides
``cfg``, ``rank``, ``device``, ``engine``, ``inference_module`` (the unsharded module the engine
uses) and ``versions`` (its weights_version). The group membership and the push to an engine are
the :class:`workers.weights_endpoint.WeightsEndpoint` the rollout workers share."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from workers.dispatch import dispatch
from workers.outcome import VersionMismatchError
from workers.weights_endpoint import WeightsEndpoint


class WeightPublisher(WeightsEndpoint):
    """Publishing the policy's weights to the rollout pool (see the module docstring)."""

    _published: dict[int, tuple[Any, int, int]]  # version -> (ObjectRef, tensors, bytes); PolicyWorker sets it

    @dispatch("rank_zero")
    def publish_weights(self, *, keep: int) -> dict[str, Any] | None:
        """Put the current weights in Ray's object store, tagged with ``weights_version`` (rank 0
        only: ``rank_zero`` dispatch). CPU tensors: the full state dict of the unsharded module, or
        with LoRA only its trainable (adapter) tensors. The ``keep`` newest versions stay referenced
        here, so a rollout rank that restarted can still fetch them (:meth:`published_weights`).
        Returns ``{"version": int, "refs": [ObjectRef], "tensors": int, "bytes": int}``."""
        import ray

        if self.rank != 0:
            return None
        version = self.versions.weights_version
        if version not in self._published:
            state = {k: v.to("cpu", copy=True) for k, v in self._publish_state().items()}
            self._published[version] = (ray.put(state), len(state), sum(t.numel() * t.element_size() for t in state.values()))
            for old in sorted(self._published)[:-keep]:
                del self._published[old]
        ref, n, size = self._published[version]
        return {"version": version, "refs": [ref], "tensors": n, "bytes": size}

    def _publish_state(self) -> dict[str, Tensor]:
        """What a publish sends: the unsharded module's state dict, with LoRA its trainable tensors only."""
        module = self.inference_module
        trainable = {n for n, p in module.named_parameters() if p.requires_grad}
        return {k: v.detach() for k, v in module.state_dict().items()
                if self.cfg.model.lora_rank == 0 or k in trainable}

    @dispatch("rank_zero")
    def init_weight_group(self, host: str, port: int, world_size: int, epoch: int) -> int:
        """Join the weight-sync group as its rank 0 (:class:`workers.weight_group.WeightGroup`; the
        rollout ranks join at the same time). ``epoch`` names this group. Returns ``epoch``."""
        return self._join_weight_group(0, host, port, world_size, epoch)

    @dispatch("rank_zero")
    def leave_weight_group(self) -> None:
        """Forget the weight-sync group (after a failed broadcast: the next publish forms a new one)."""
        self._weight_group = None

    @dispatch("rank_zero")
    def weight_group_epoch(self) -> int | None:
        """The epoch of the weight-sync group this rank is in (None: none)."""
        return self._group_epoch()

    @dispatch("rank_zero")
    def weights_layout(self) -> list[tuple[str, list[int], str]]:
        """``[(name, shape, dtype)]`` of what :meth:`broadcast_weights` sends, in its order."""
        from workers.weight_group import layout_of

        return layout_of(self._publish_state())

    @dispatch("rank_zero")
    def broadcast_weights(self, version: int) -> dict[str, Any]:
        """Broadcast the current weights (``version`` = weights_version, checked) through the
        weight-sync group, on the device they live on. Returns ``{"version", "bytes"}``. Raises
        RuntimeError without a group, VersionMismatchError on another version."""
        group = self._group("policy rank 0")
        if version != self.versions.weights_version:
            raise VersionMismatchError(f"broadcast of weights_version {version}; the policy is at "
                                       f"{self.versions.weights_version}")
        tensors = [t.contiguous() for t in self._publish_state().values()]
        group.broadcast(tensors)
        return {"version": version, "bytes": sum(t.numel() * t.element_size() for t in tensors)}

    @dispatch("rank_zero")
    def published_weights(self, version: int) -> dict[str, Any] | None:
        """The weights of ``version`` as :meth:`publish_weights` returned them (rank 0; published now
        when ``version`` is the current one), or None when they are no longer (or not yet) kept."""
        if self.rank != 0:
            return None
        if version == self.versions.weights_version:
            return self.publish_weights(keep=max(len(self._published) + 1, 2))
        if version not in self._published:
            return None
        ref, n, size = self._published[version]
        return {"version": version, "refs": [ref], "tensors": n, "bytes": size}


__all__ = ["WeightPublisher"]
