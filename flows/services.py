"""Start and stop what a command needs, in one place: ``with services(cfg, ...):``.

``hybridflow train``, ``hybridflow eval`` and ``hybridflow node run`` each run inside it. On entry it
makes SIGTERM and SIGHUP unwind like Ctrl-C (:func:`stop_on_sigterm`), optionally starts the reaper watchdog
(:func:`flows.runtime.start_reaper`: what the command starts dies with it, even after a SIGKILL),
uses ``$PREFECT_API_URL`` or starts a local Prefect server on 127.0.0.1
(:func:`flows.runtime.launch_prefect_api`; Prefect's server-less ephemeral mode does not work under
Ray), and optionally starts Ray now (else whatever runs inside starts it on demand,
:func:`flows.runtime.ensure_ray`). On exit, however the body ends, it stops what it started and
nothing else: Ray if it was not running on entry, then the Prefect server after sending Prefect's
queued logs and events (:func:`drain_prefect_services`); the previous signal handlers are restored.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flows import runtime, signals
from workers.runtime import ray_running, stop_ray


@dataclass(frozen=True)
class Services:
    """What :func:`services` brought up. ``prefect_url``: the Prefect API the command uses (None
    without Prefect); ``prefect_home``: the local server's folder ("" when the API was given by
    ``$PREFECT_API_URL``, None without Prefect)."""

    prefect_url: str | None
    prefect_home: str | None


#: Exported while :func:`services` holds a local Prefect server: that server's folder, absolute. The
#: train flow records it in run.json (``prefect_home``, :func:`prefect_location`), so ``--resume``
#: goes back to the same server database whatever the working directory (:func:`resume_prefect_home`).
PREFECT_HOME_ENV = "HYBRIDFLOW_PREFECT_HOME"


def prefect_location() -> dict[str, str]:
    """``{"prefect_home": <absolute folder>}`` of the local Prefect server this command started, for
    run.json; {} when the API is the user's (``$PREFECT_API_URL``) or no server was started here."""
    home = os.environ.get(PREFECT_HOME_ENV)
    return {"prefect_home": home} if home else {}


def resume_prefect_home(given: str | None, resume: str | None) -> str | None:
    """The Prefect home a command uses: ``--prefect-home`` when given; else, resuming, the one the
    run recorded when it started (run.json ``prefect_home``, absolute); else None (the default,
    :func:`default_prefect_home`)."""
    if given or not resume:
        return given
    from flows.run_dir import RunDir

    try:
        recorded = RunDir(resume).run_info().get("prefect_home")
    except (OSError, ValueError):  # a damaged run.json was refused by the preflight already
        return None
    return recorded if isinstance(recorded, str) and os.path.isabs(recorded) else None


def default_prefect_home(cfg: Any) -> str:
    """``<trainer.run_dir>/.prefect`` (absolute): where a local Prefect server keeps its SQLite db."""
    return str(Path(cfg.trainer.run_dir).resolve() / ".prefect")


def stop_on_sigterm(prefect: bool = False) -> Any:
    """SIGINT, SIGTERM (``timeout``, ``kill``, a scheduler stopping the job) and SIGHUP unwind
    alike (:mod:`flows.signals`, also inside Prefect flow runs), so the ``finally`` blocks stop Ray
    and the Prefect server this command started, and release the run folder's lock, instead of
    leaving them behind. Exit status 130/143/129. ``prefect``: also inside Prefect flow runs (whose
    engine would install its own SIGTERM handler). Returns the previous handlers (None off the main
    thread, where handlers cannot be set); :func:`flows.signals.restore` puts them back."""
    return signals.install(prefect=prefect)


def drain_prefect_services(timeout_s: float = 20.0) -> None:
    """Send queued Prefect logs/events while the server is still up: once we stop the server, the
    interpreter's at-exit drain would otherwise wait on a server that is gone."""
    try:
        from prefect._internal.concurrency.services import QueueService

        QueueService.drain_all(timeout=timeout_s)
    except Exception:  # best effort: never turn a finished run into a failure
        pass


@contextmanager
def services(cfg: Any, *, prefect: bool = True, prefect_home: str | None = None, ray: bool = False,
             reaper: bool = False) -> Iterator[Services]:
    """Bring up what a command needs for the body of the ``with``, and stop it afterwards.

    cfg: the ExperimentConfig the command runs (Ray's resources, ``placement.ray_address``,
    ``trainer.run_dir`` for the default Prefect home); None for a command that needs neither.
    prefect: use ``$PREFECT_API_URL`` or start a local server under ``prefect_home`` (default
    :func:`default_prefect_home`). ray: start Ray (or join ``placement.ray_address``) on entry;
    without it, Ray started inside the body (by a flow or a pool) is stopped at exit just the same.
    reaper: start the reaper watchdog first.
    Raises RuntimeError when the Prefect API is unreachable or the server does not come up.
    """
    previous = stop_on_sigterm(prefect=prefect)
    ray_was_running = ray_running()
    if reaper:
        runtime.start_reaper()  # what this command starts from here on dies with it, even after a SIGKILL
    server = None
    api_url_before = os.environ.get("PREFECT_API_URL")  # unset: launch_prefect_api exports its server's
    home_before = os.environ.get(PREFECT_HOME_ENV)
    try:
        if prefect:  # launched, not waited for: Ray starts while it boots (a core each on 2 cores)
            server = runtime.launch_prefect_api(prefect_home or default_prefect_home(cfg))
            if server.home:
                os.environ[PREFECT_HOME_ENV] = str(Path(server.home).resolve())
        if ray:
            runtime.ensure_ray(cfg)
            stop_on_sigterm(prefect=prefect)  # ray.init installs its own SIGTERM handler, which aborts the driver (exit -6)
        if server is not None:
            server.wait_healthy()
        yield Services(server.url if server else None, (server.home or "") if server else None)
    finally:
        try:
            if not ray_was_running:
                stop_ray()
        finally:
            if server is not None:
                drain_prefect_services()
                server.stop()
                if not api_url_before and os.environ.get("PREFECT_API_URL") == server.url:
                    runtime.set_prefect_api_url(None)  # exported by launch_prefect_api for the server now stopped
            if home_before is None:
                os.environ.pop(PREFECT_HOME_ENV, None)
            else:
                os.environ[PREFECT_HOME_ENV] = home_before
            sys.stdout.flush()
            signals.restore(previous)
