"""Imported at start-up by every process :func:`tests.ddp.run_script` launches (this folder is on its PYTHONPATH),
the ranks Lightning starts from it included.

A process that exits with a gloo process group still alive can abort in the interpreter's finalisation ("terminate
called without an active exception": gloo's threads still hold work when the interpreter tears down), failing a
run that did all it had to. Lightning does not destroy the group at the end of a fit, so it is destroyed here,
at exit, while the interpreter is whole.
"""

import atexit
import importlib.machinery
import importlib.util
import os
import sys


def _destroy_process_group() -> None:
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        distributed.destroy_process_group()


atexit.register(_destroy_process_group)


def _run_the_next_sitecustomize() -> None:
    """Python imports one ``sitecustomize``: this one comes first on the path, so the one it hides (a distribution's,
    a coverage hook's) runs from here."""
    here = os.path.dirname(os.path.abspath(__file__))
    later = [entry for entry in sys.path if os.path.abspath(entry or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_run_the_next_sitecustomize()
