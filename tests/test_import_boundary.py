"""The HTTP process must start small and fast: nothing it imports may import paddle."""

import pkgutil
import subprocess
import sys

import mtpserve.ipc
import mtpserve.server
import mtpserve.web

PADDLE_FREE = ("mtpserve.server", "mtpserve.web", "mtpserve.ipc", "mtpserve.config", "mtpserve.instance",
               "mtpserve.cli", "mtpserve.log", "mtpserve.launcher", "mtpserve.preflight",
               "mtpserve.tokenizer", "mtpserve.chat_template")


def paddle_free_modules() -> list[str]:
    names = list(PADDLE_FREE)
    for package in (mtpserve.server, mtpserve.web, mtpserve.ipc):
        names += [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
    return names


def test_http_side_never_imports_paddle():
    probe = (
        "import importlib, importlib.util, sys\n"
        "for name in sys.argv[1:]:\n"
        "    if importlib.util.find_spec(name) is not None:\n"
        "        importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m == 'paddle' or m.startswith('paddle.'))\n"
        "print('paddle imported' if bad else 'clean')\n"
    )
    out = subprocess.run([sys.executable, "-c", probe, *paddle_free_modules()], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean"


def test_probe_detects_paddle():
    """The check above can fail: importing the ops module does pull paddle in."""
    probe = "import mtpserve.ops, sys; print('paddle' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True"
