"""The chaos soak (``make test-chaos``; its short form ``make test-chaos-short`` runs in ``.ci/run``):
a seeded tiny-model run hit by faults at seeded random points and resumed after each fault that
ends its driver must end bitwise equal to the uninterrupted run of the same config and seed —
final weights, every non-timing metric, the policy update ledger (each update exactly once, on
the same batch). What the faults are: ``tests/chaos/soak.py``.

Environment: ``CHAOS_SEED`` (default 0), ``CHAOS_FAULTS`` (faults per mode, default 5),
``CHAOS_ITERATIONS`` (default 20), ``CHAOS_MODES`` (``sync``, ``async`` or ``sync,async``;
default ``sync``), ``CHAOS_KINDS`` (comma-separated fault kinds to draw from; default all). Prints the faults injected and survived by kind.
"""

from __future__ import annotations

import io
import os
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from tests.chaos.soak import (
    KINDS,
    Soak,
    env_int,
    ledger,
    mount_tmpfs,
    overrides,
    plan,
    run_chaos,
    table,
    umount,
    write_data,
)
from tests.fixtures.compare_runs import compare

pytestmark = [pytest.mark.chaos, pytest.mark.integration, pytest.mark.timeout(3600)]

SEED = env_int("CHAOS_SEED", 0)
FAULTS = env_int("CHAOS_FAULTS", 5)
ITERATIONS = env_int("CHAOS_ITERATIONS", 20)
MODES = [m.strip() for m in os.environ.get("CHAOS_MODES", "sync").split(",") if m.strip()]
CHAOS_KINDS = tuple(k.strip() for k in os.environ.get("CHAOS_KINDS", ",".join(KINDS)).split(",") if k.strip())
SOAKS: list[Soak] = []


def test_the_plan_is_seeded_and_covers_every_kind():
    a, b = plan(SEED, 6, 20, "sync"), plan(SEED, 6, 20, "sync")
    assert a == b and {f.kind for f in a} == set(KINDS)
    assert plan(SEED + 1, 6, 20, "sync") != a
    assert all(5 <= f.iteration < 20 for f in a) and len({f.iteration for f in a}) == 6


@pytest.mark.parametrize("mode", MODES)
def test_chaos_soak_ends_bitwise_equal_to_the_uninterrupted_run(mode, prefect_api, ray_cluster, tmp_path):
    from flows.train import train

    t0 = time.monotonic()
    ray = ray_cluster
    address = ray.get_runtime_context().gcs_address
    assert set(CHAOS_KINDS) <= set(KINDS), f"CHAOS_KINDS: unknown {set(CHAOS_KINDS) - set(KINDS)}"
    soak = Soak(mode, ITERATIONS, SEED, tmp_path, plan(SEED, FAULTS, ITERATIONS, mode, CHAOS_KINDS))
    SOAKS.append(soak)
    data = write_data(tmp_path / "data")
    soak.say(f"seed {SEED}, {ITERATIONS} iterations, plan: "
             + ", ".join(f"{f.kind}@{f.iteration}" + (f"/{f.node}" if f.kind.startswith(("driver", "enospc")) else "")
                         for f in soak.faults))

    ref = Path(train(overrides=overrides(soak, data, tmp_path / "ref-runs", "reference", address))["run_dir"])
    soak.say(f"reference run done in {time.monotonic() - t0:.0f} s")

    runs = tmp_path / "runs"
    tmpfs = mount_tmpfs(runs)
    soak.say(f"run folder on a {'64 MiB tmpfs' if tmpfs else 'plain folder (mount not allowed: enospc skipped)'}")
    try:
        run_dir = runs / "chaos"
        run_chaos(soak, overrides(soak, data, runs, "chaos", address), run_dir, runs, tmpfs)
        report = io.StringIO()
        with redirect_stdout(report):
            equal = compare(run_dir, ref)
        for line in report.getvalue().splitlines():
            soak.say(line)
        same_ledger = ledger(run_dir) == ledger(ref)
        soak.say(f"update ledger: {len(ledger(run_dir))} updates, versions "
                 f"{[e[0] for e in ledger(run_dir)][:3]}..{ledger(run_dir)[-1][0]}, "
                 f"{'equal' if same_ledger else 'DIFFERENT'} to the uninterrupted run's")
        soak.say(f"soak wall time {time.monotonic() - t0:.0f} s")
        print(table([soak]), flush=True)
        assert equal, report.getvalue()
        assert same_ledger, (ledger(run_dir), ledger(ref))
        assert [e[:2] for e in ledger(run_dir)] == [(v, v + 1) for v in range(ITERATIONS)]  # exactly once, in order
        injected = [f for f in soak.faults if "skipped" not in f.detail]
        assert len(injected) >= min(FAULTS, 5), soak.faults
        assert all(f.survived for f in injected), [f for f in injected if not f.survived]
    finally:
        if tmpfs:
            umount(runs)


def teardown_module(module):
    if SOAKS:
        print("\nchaos soak: faults by kind\n" + table(SOAKS), flush=True)
