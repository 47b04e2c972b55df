"""On ``PYTHONPATH`` only while the device kit records imports (run.sh with
``SKYRL_KIT_RECORD_IMPORTS=DIR``): at exit, every Python process of the checks writes the
top-level modules it imported from outside the standard library and outside the project,
with the file each came from, to ``DIR/imports-<pid>.json``. tests/test_device_kit.py maps
them to distributions and checks each is on the lent machine or carried."""

import atexit
import json
import os
import sys

_DIR = os.environ.get("SKYRL_KIT_RECORD_IMPORTS")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _where(module):
    path = getattr(module, "__file__", None)
    if path is None:
        paths = list(getattr(module, "__path__", []) or [])
        path = paths[0] if paths else None
    return os.path.abspath(path) if path else None


def _record():
    seen = {}
    for name, module in list(sys.modules.items()):
        top = name.partition(".")[0]
        if top in seen or top in sys.stdlib_module_names or module is None:
            continue
        where = _where(sys.modules.get(top) or module)
        if where is None or (where.startswith(_ROOT + os.sep) and "-packages" + os.sep not in where):
            continue
        seen[top] = where
    path = os.path.join(_DIR, f"imports-{os.getpid()}.json")
    with open(path, "w") as fh:
        json.dump({"argv": sys.argv[:3], "modules": seen}, fh)


if _DIR:
    atexit.register(_record)
