"""The Ray runtime of this process: start a local Ray (or join a cluster) and stop it.

The one place above which nothing starts or stops Ray (``flows.runtime.ensure_ray`` and
``flows.services.services`` call these). Ray is imported only when a function needs it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def ray_running() -> bool:
    """Whether this process has a Ray runtime (ray not imported: no)."""
    ray = sys.modules.get("ray")  # not imported: not running (and not imported here for nothing)
    return ray is not None and ray.is_initialized()


def loopback_ray() -> None:
    """Make a local Ray take 127.0.0.1 as its node address, so that its GCS, raylet, workers,
    dashboard agent (gRPC, HTTP and the metrics export port), runtime-env agent and autoscaler
    metrics server all bind 127.0.0.1 (Ray binds loopback only when the node address is loopback).

    ``ray.init(_node_ip_address="127.0.0.1")`` alone does not do it: Ray replaces a loopback
    address by the machine's routable one unless its single-machine mode is on
    (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, the default on macOS/Windows; ray 2.60
    ``ray._private.services.resolve_ip_for_localhost``). Ray reads that variable when imported:
    it is set in the environment (Ray's processes inherit it) and, if ray is already imported in
    this process, on its constants module as well."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False


def start_ray(*, address: str | None, num_cpus: float, num_gpus: float, **init_options: Any) -> None:
    """Start a local Ray on 127.0.0.1 with ``num_cpus`` / ``num_gpus`` logical resources (rounded up;
    0 GPUs: none declared), or join the cluster at ``address``; nothing when Ray is already running.
    ``init_options``: passed to ``ray.init`` (runtime_env, namespace, logging, ...). Raises what
    ``ray.init`` raises (a local start that timed out waiting for its raylet is tried again)."""
    import ray

    if ray.is_initialized():
        return
    with keep_stop_handlers():
        _start_ray(ray, address, num_cpus, num_gpus, init_options)


@contextmanager
def keep_stop_handlers() -> Iterator[None]:
    """Put the caller's Python handlers of SIGINT, SIGTERM and SIGHUP back after the body: ``ray.init``
    installs Ray's own (a C++ handler that prints "SIGTERM received" and aborts the driver), which
    would bypass a command's shutdown path (flows/signals.py) whenever Ray starts on demand inside it.
    Defaults the caller never replaced are left to Ray. Main thread only (elsewhere: nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            if callable(handler) and handler is not signal.default_int_handler:
                signal.signal(s, handler)


def _start_ray(ray: Any, address: str | None, num_cpus: float, num_gpus: float, init_options: dict) -> None:
    if address:
        ray.init(address=address, **init_options)
        return
    # Node tasks ask for zero CPUs, but Ray keeps only `num_cpus` idle workers warm; with pools holding
    # every CPU, each iteration would pay for new task-worker processes (Prefect + torch imports).
    os.environ.setdefault("RAY_num_workers_soft_limit", "8")
    # Ray's tqdm helper replaces print() in the driver, which undoes Prefect's log_prints
    os.environ.setdefault("RAY_TQDM_PATCH_PRINT", "0")
    # Ray starts workers at nice 15 by default; the pools' actors *are* the compute here, and at
    # nice 15 any other process (Prefect server, driver) takes the CPU from them on a small machine
    os.environ.setdefault("RAY_worker_niceness", "0")
    loopback_ray()
    quiet_token_auth_notice()
    init_local_ray(num_cpus=int(-(-num_cpus // 1)), num_gpus=int(-(-num_gpus // 1)) or None,
                   _node_ip_address="127.0.0.1", **init_options)


class _NoTokenAuthNotice(logging.Filter):
    """Ray's ``Token authentication is enabled for this Ray cluster`` WARNING on every local start:
    token authentication is what we want (left on); the notice is noise on every run's console."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Token authentication is enabled")


def quiet_token_auth_notice() -> None:
    """Drop Ray's token-authentication notice (only that one) from the driver's logs."""
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _NoTokenAuthNotice) for f in logger.filters):
        logger.addFilter(_NoTokenAuthNotice())


def init_local_ray(attempts: int = 3, **kwargs: Any) -> None:
    """``ray.init`` of a local node, tried again when Ray gives up waiting for its own raylet
    (a fixed 30 s in ray/_private/node.py: "The current node timed out during startup"), which a
    loaded 2-core machine reached at load average 30; any other error is raised at once."""
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(**kwargs)
            return
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception here
            if "timed out during startup" not in str(e) or attempt == attempts:
                raise
            ray.shutdown()


def stop_ray() -> None:
    """Stop this process's Ray runtime, if it has one."""
    if ray_running():
        sys.modules["ray"].shutdown()


__all__ = ["init_local_ray", "loopback_ray", "ray_running", "start_ray", "stop_ray"]
