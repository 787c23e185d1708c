"""One way for tests to launch a multi-process (gloo) script: a fresh interpreter, never pytest's argv."""

from __future__ import annotations

import os
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
