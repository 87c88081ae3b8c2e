"""The router is an HTTP process like the instance's: none of its modules may import paddle, and it
shares only mtpserve.web with the instance's HTTP process, never the server's own modules."""

import pkgutil
import subprocess
import sys

import mtpserve.router


def test_router_never_imports_paddle():
    names = ["mtpserve.router"] + [m.name for m in pkgutil.walk_packages(mtpserve.router.__path__, "mtpserve.router.")]
    probe = ("import importlib, sys\n"
             "for name in sys.argv[1:]:\n"
             "    importlib.import_module(name)\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'paddle'"
             " or m.startswith('mtpserve.server')))\n")
    out = subprocess.run([sys.executable, "-c", probe, *names], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]" and len(names) > 10


def test_the_probe_sees_server_modules():
    """The check above can fail: the server's routes do pull in mtpserve.server modules."""
    probe = "import sys, mtpserve.server.app; print(any(m.startswith('mtpserve.server.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr
