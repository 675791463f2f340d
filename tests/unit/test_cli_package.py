"""The thin CLI (issue 14): flows/cli/ is argparse and printing only, imported by no library module;
one override parser for every subcommand; one ``services()`` context manager that stops what it
started and nothing else, however the command ends."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.cli import build_parser, main
from flows.cli.args import is_override

ROOT = Path(__file__).resolve().parents[2]


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_no_library_module_imports_the_cli():
    cli = ROOT / "flows" / "cli"
    library = [p for layer in ("hybridflow", "workers", "tasks", "flows") for p in (ROOT / layer).rglob("*.py")
               if cli not in p.parents]
    assert len(library) > 50
    bad = [f"{p.relative_to(ROOT)}: {sorted(m for m in _imported_modules(p) if m.startswith('flows.cli'))}"
           for p in library if any(m == "flows.cli" or m.startswith("flows.cli.") for m in _imported_modules(p))]
    assert not bad, bad


def test_cli_modules_do_not_import_one_another():
    # the package's own helpers (the override parser) are shared; subcommand modules are not
    allowed = {"flows.cli.args", "flows.cli.args.OverridesAnywhere", "flows.cli.args.add_overrides",
               "flows.cli.args.is_override"}
    for p in sorted((ROOT / "flows" / "cli").glob("*.py")):
        used = {m for m in _imported_modules(p) if m.startswith("flows.cli.")}
        if p.name in ("__init__.py", "__main__.py"):
            continue
        assert used <= allowed, (p.name, used - allowed)


def test_help_is_fast_and_the_entry_points_work():
    code = ("import sys; from flows.cli import build_parser; build_parser().format_help(); "
            "heavy = {'torch', 'prefect', 'ray', 'transformers'} & set(sys.modules); assert not heavy, heavy")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    out = subprocess.run([sys.executable, "-m", "flows.cli", "--help"], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0 and "node" in out.stdout and "bench" in out.stdout
    assert 'hybridflow = "flows.cli:main"' in (ROOT / "pyproject.toml").read_text()  # the console script


# ---- one override parser -------------------------------------------------------------------------


@pytest.mark.parametrize(("arg", "expected"), [
    ("actor.lr=3e-6", True), ("data.val_files=[a.parquet]", True), ("placement.pools.main.workers=2", True),
    ("lr=3e-6", False), ("a.parquet", False), ("--step=2", False), ("runs/x", False), ("1.5=x", False),
])
def test_is_override(arg, expected):
    assert is_override(arg) is expected


def test_every_subcommand_takes_overrides_anywhere():
    parse = build_parser().parse_args
    args = parse(["eval", "--model", "m", "--data", "a.parquet", "b.parquet", "x.y=1", "--samples", "2", "z.w=3"])
    assert args.data == ["a.parquet", "b.parquet"] and args.overrides == ["x.y=1", "z.w=3"]
    args = parse(["node", "run", "advantage", "a.b=1", "--run", "r", "-i", "1", "c.d=2"])
    assert (args.node, args.run, args.iteration, args.overrides) == ("advantage", "r", 1, ["a.b=1", "c.d=2"])
    args = parse(["config", "show", "-c", "x.yaml", "actor.lr=3e-6"])
    assert args.overrides == ["actor.lr=3e-6"]
    args = parse(["train", "a.b=1", "-c", "x.yaml", "c.d=2", "--resume", "r"])
    assert args.overrides == ["a.b=1", "c.d=2"]
    with pytest.raises(SystemExit):  # what is neither an option nor an override is still refused
        parse(["node", "run", "advantage", "--run", "r", "-i", "1", "stray"])


# ---- one services() -------------------------------------------------------------------------------


class FakeRay:
    def __init__(self, up: bool):
        self.up, self.shutdowns = up, 0

    def is_initialized(self) -> bool:
        return self.up

    def shutdown(self) -> None:
        self.up, self.shutdowns = False, self.shutdowns + 1


@pytest.fixture
def fakes(monkeypatch):
    """flows.runtime's starters replaced: a server whose stop() and a Ray whose start/stop are recorded."""
    import flows.runtime
    import flows.services

    events: list[str] = []

    class Server:
        url, home, proc = "http://127.0.0.1:1/api", "/tmp/home", "started by launch_prefect_api"

        def wait_healthy(self):
            events.append("server.healthy")
            return self

        def stop(self):
            events.append("server.stop")

    ray = FakeRay(up=False)

    def ensure_ray(cfg):
        events.append("ray.start")
        ray.up = True

    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setattr(flows.runtime, "launch_prefect_api", lambda home: events.append(f"prefect {home}") or Server())
    monkeypatch.setattr(flows.runtime, "ensure_ray", ensure_ray)
    monkeypatch.setattr(flows.runtime, "start_reaper", lambda: events.append("reaper"))
    monkeypatch.setattr(flows.services, "drain_prefect_services", lambda: events.append("drain"))
    # the process's default handlers, whatever an earlier test in this process left installed
    previous = {s: signal.signal(s, signal.SIG_DFL) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield events, ray
    for s, handler in previous.items():
        signal.signal(s, handler)


def _cfg(tmp_path):
    from hybridflow.config import load_config

    return load_config(None, [f"trainer.run_dir={tmp_path}"])


def test_services_starts_what_is_asked_and_stops_it_in_order(fakes, tmp_path):
    from flows.services import services

    events, ray = fakes
    handler = signal.getsignal(signal.SIGTERM)
    with services(_cfg(tmp_path), ray=True, reaper=True) as running:
        assert running.prefect_url == "http://127.0.0.1:1/api" and running.prefect_home == "/tmp/home"
        assert signal.getsignal(signal.SIGTERM) is not handler  # SIGTERM unwinds while the services run
        events.append("body")
    # the server is launched, Ray starts while it boots, then the body waits for it to be healthy
    assert events == ["reaper", f"prefect {tmp_path.resolve() / '.prefect'}", "ray.start", "server.healthy", "body",
                      "drain", "server.stop"]
    assert ray.shutdowns == 1 and not ray.up
    assert signal.getsignal(signal.SIGTERM) is handler  # restored


def test_services_unsets_the_prefect_api_url_of_the_server_it_stopped(monkeypatch, tmp_path):
    """launch_prefect_api exports the URL of the server it starts; once that server is stopped the
    variable goes (a Prefect settings copy re-reads the environment and would point at a dead server);
    a URL the user gave stays."""
    import os

    import flows.runtime
    import flows.services
    from flows.services import services

    class Server:
        def __init__(self, url, proc):
            self.url, self.home, self.proc = url, "/tmp/home", proc

        def wait_healthy(self):
            return self

        def stop(self):
            pass

    def started(home):
        os.environ["PREFECT_API_URL"] = "http://127.0.0.1:2/api"
        return Server("http://127.0.0.1:2/api", proc="ours")

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setattr(flows.services, "drain_prefect_services", lambda: None)
    monkeypatch.setattr(flows.runtime, "launch_prefect_api", started)
    with services(_cfg(tmp_path)):
        assert os.environ["PREFECT_API_URL"] == "http://127.0.0.1:2/api"
    assert "PREFECT_API_URL" not in os.environ

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:3/api")
    monkeypatch.setattr(flows.runtime, "launch_prefect_api", lambda home: Server("http://127.0.0.1:3/api", None))
    with services(_cfg(tmp_path)):
        pass
    assert os.environ["PREFECT_API_URL"] == "http://127.0.0.1:3/api"  # the user's server: not ours to forget


def test_services_leaves_a_running_ray_and_skips_prefect_when_not_needed(fakes, tmp_path):
    from flows.services import services

    events, ray = fakes
    ray.up = True  # e.g. a session's Ray, or ray.init() by the caller
    with services(_cfg(tmp_path), ray=True, prefect=False):
        events.append("body")
    assert events == ["ray.start", "body"] and ray.shutdowns == 0 and ray.up


def test_services_stops_ray_started_inside_the_body_and_on_errors(fakes, tmp_path):
    from flows.services import services

    events, ray = fakes
    with pytest.raises(RuntimeError, match="node failed"), services(None, prefect=False):
        ray.up = True  # a pool the body needed started Ray
        raise RuntimeError("node failed")
    assert ray.shutdowns == 1


def test_sigterm_in_the_body_stops_the_services_with_exit_143(fakes, tmp_path):
    from flows import signals
    from flows.services import services

    events, ray = fakes
    try:
        with pytest.raises(signals.Stopped) as stop, \
                services(_cfg(tmp_path), prefect_home=str(tmp_path / "h"), ray=True):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler raises in this thread as soon as the signal is delivered
            raise AssertionError("SIGTERM did not unwind the body")
        assert stop.value.stop.exit_code == 128 + signal.SIGTERM and stop.value.stop.reason == "terminated"
        assert events[-2:] == ["drain", "server.stop"] and ray.shutdowns == 1
    finally:
        signals.reset()  # its watchdog would end this process


def test_a_prefect_api_that_does_not_answer_stops_nothing_else(fakes, tmp_path, monkeypatch):
    import flows.runtime
    from flows.services import services

    events, ray = fakes
    handler = signal.getsignal(signal.SIGTERM)

    def unreachable(home):
        raise RuntimeError("PREFECT_API_URL=http://x is not reachable")

    monkeypatch.setattr(flows.runtime, "launch_prefect_api", unreachable)
    with pytest.raises(RuntimeError, match="not reachable"), services(_cfg(tmp_path), ray=True):
        pass
    assert events == [] and ray.shutdowns == 0 and signal.getsignal(signal.SIGTERM) is handler


# ---- one-line errors --------------------------------------------------------------------------------


def test_train_resume_errors_have_the_error_prefix(tmp_path, capsys, monkeypatch):
    import flows.runtime

    def tripwire(*a, **k):
        raise AssertionError("a server was started before the arguments were checked")

    monkeypatch.setattr(flows.runtime, "launch_prefect_api", tripwire)
    monkeypatch.setattr(flows.runtime, "ensure_ray", tripwire)
    assert main(["train", "--resume", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --resume {tmp_path / 'nope'}: {tmp_path / 'nope'} is not a run directory " \
                  "(no run.json / config.yaml)"
    assert main(["train", "-c", str(tmp_path / "none.yaml")]) == 2  # a ConfigError keeps its own prefix
    assert capsys.readouterr().err.strip() == f"config error: file {str(tmp_path / 'none.yaml')!r} does not exist"


def test_prefect_imported_before_the_server_starts_still_uses_the_run_server(tmp_path):
    """Prefect builds its settings when first imported; the CLI imports it (the signal set-up, the
    flows) before ``launch_prefect_api`` exports the URL of the server it starts. Flow runs must still
    go to that server, not to a server-less ephemeral API of their own (``$PREFECT_HOME/prefect.db``,
    an extra server inside the driver), and once ``services()`` ends Prefect forgets the URL again.
    A fresh interpreter: no test's settings context in the way."""
    script = f"""
import os
os.environ.pop("PREFECT_API_URL", None)
os.environ["PREFECT_HOME"] = {str(tmp_path / "home")!r}
import prefect  # imported first, as the CLI does
from prefect.settings import get_current_settings
import flows.runtime, flows.services

class Server:
    url, home = "http://127.0.0.1:9/api", "/nowhere"
    def wait_healthy(self): return self
    def stop(self): pass

flows.runtime.launch_prefect_server = lambda home, **kw: Server()
flows.services.drain_prefect_services = lambda: None
with flows.services.services(None, prefect_home={str(tmp_path / "run-home")!r}) as s:
    print("inside", s.prefect_url, get_current_settings().api.url)
print("after", os.environ.get("PREFECT_API_URL"), get_current_settings().api.url)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-2] == "inside http://127.0.0.1:9/api http://127.0.0.1:9/api", proc.stdout
    assert lines[-1] == "after None None", proc.stdout


def test_one_reaper_per_process_however_many_commands_it_runs():
    """A process that runs several commands (a test session, a notebook calling flows.cli.main) gets
    one reaper, not one per command: each polls the process tree every second (30 of them, one per
    in-process eval/train of a test session, took a CPU core in CI). A fresh interpreter."""
    script = """
import psutil
from flows.runtime import start_reaper
a = start_reaper()
b = start_reaper()
mine = [p for p in psutil.process_iter(["cmdline"]) if "flows.reaper" in " ".join(p.info["cmdline"] or [])
        and str(psutil.Process().pid) in (p.info["cmdline"] or [])]
print(a is b, len(mine))
a.kill()
a.wait()
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "1"], proc.stdout + proc.stderr[-2000:]
