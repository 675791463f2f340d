"""``hybridflow train`` stopped with SIGTERM stops the Prefect server (and Ray) it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# a train command whose server start and flow are stand-ins: the server's stop() leaves a marker,
# the flow sleeps until it is signalled
SCRIPT = r"""
import sys, time
from pathlib import Path
import flows.runtime, flows.train
marker = Path(sys.argv[1])

class Server:
    url, home = "http://127.0.0.1:1/api", None
    def wait_healthy(self):
        return self
    def stop(self):
        marker.write_text("stopped")

flows.runtime.launch_prefect_api = lambda home: Server()
def train(**kw):
    Path(str(marker) + ".started").write_text("")
    time.sleep(60)
flows.train.train = train
import flows.cli.train
flows.cli.train._preflight = lambda cfg, resume: None
from flows.cli import main
sys.exit(main(["train", "model.path=tiny", f"trainer.run_dir={marker.parent}"]))
"""


def test_sigterm_stops_the_servers_the_command_started(tmp_path):
    marker = tmp_path / "server-stopped"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(marker)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300  # imports only, but a loaded CI machine is slow
        while not Path(str(marker) + ".started").exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the stand-in flow never started"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 128 + signal.SIGTERM
    assert marker.read_text() == "stopped"
