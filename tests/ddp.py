"""One way for tests to launch a multi-process (gloo) script: a fresh interpreter, never pytest's argv."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_script(script: Path | str, *args: object, timeout: float = 300, env: dict | None = None,
               cwd: Path | str | None = None) -> subprocess.CompletedProcess:
    """Run ``python script args...`` with the repository importable; assert it exits 0.

    The script launches its own processes (Lightning's ``ddp`` re-executes ``sys.argv``, which is the
    script here, not pytest). On failure the assertion shows the end of its stderr and stdout.
    """
    # tests/_site: its sitecustomize destroys the process group at exit (see there)
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(Path(script).parent), str(REPO / "tests" / "_site")]))
    full_env.update(env or {})
    done = subprocess.run([sys.executable, str(script), *map(str, args)], env=full_env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{script} failed:\n{done.stderr[-4000:]}\n{done.stdout[-2000:]}"
    return done


def free_port() -> int:
    """A TCP port free on this machine now (for MASTER_PORT: never a fixed one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(script: Path | str, *args: object, world: int = 2, timeout: float | None = None,
                 env: dict[str, str] | None = None) -> list[int]:
    """Start ``world`` processes running ``python script args...``, each a rank of one process group (rank, world size
    and a free port in its environment, besides ``env``, so every Trainer in them joins that group), and wait for them:
    their exit codes. A rank still running when the wait ends early (``timeout``) is killed. What a launched script's
    parent does before its ranks run their part."""
    port = str(free_port())
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(world), NODE_RANK="0", **(env or {}))
    procs = [subprocess.Popen([sys.executable, str(script), *map(str, args)], env=dict(base, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(world)]
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
