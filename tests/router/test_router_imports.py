"""The router is an HTTP process like the instance's: none of its modules may import paddle."""

import pkgutil
import subprocess
import sys

import mtpserve.router


def test_router_never_imports_paddle():
    names = ["mtpserve.router"] + [m.name for m in pkgutil.walk_packages(mtpserve.router.__path__, "mtpserve.router.")]
    probe = ("import importlib, sys\n"
             "for name in sys.argv[1:]:\n"
             "    importlib.import_module(name)\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'paddle'))\n")
    out = subprocess.run([sys.executable, "-c", probe, *names], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]" and len(names) > 10
