"""Static type check of the whole repository: `make typecheck` (CI runs it first, from .ci/run).

The import package `mtpserve` is assembled by setup.py's `package_dir` (daemon/ -> mtpserve, ipc/ ->
mtpserve.ipc, config/ -> mtpserve.config), which no static checker follows. This script:
  1. reads that mapping from setup.py (the one place it is declared);
  2. writes the path map: build/typecheck/mtpserve/, a tree of directories whose .py files are
     symlinks to the sources, laid out as the installed package (rebuilt on every run, so a new module
     is never missed);
  3. runs basedpyright (pyrightconfig.json: standard mode) over that tree, tests/ and scripts/, and
     prints each diagnostic at its real path (daemon/engine/x.py, not build/...).
Exit status: 0 when there is no error, 1 otherwise (unresolved imports are errors).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "typecheck"


def package_dir() -> dict[str, str]:
    """setup.py's package_dir literal: import package -> source directory."""
    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text())):
        if isinstance(node, ast.keyword) and node.arg == "package_dir":
            value = ast.literal_eval(node.value)
            assert isinstance(value, dict)
            return {str(k): str(v) for k, v in value.items()}
    raise SystemExit("setup.py has no package_dir")


def build_tree(mapping: dict[str, str]) -> dict[Path, Path]:
    """Link every .py file of each source directory under its package path; returns link -> source."""
    shutil.rmtree(TREE, ignore_errors=True)
    links: dict[Path, Path] = {}
    for package, source in sorted(mapping.items()):
        top = ROOT / source
        for path in sorted(_sources(top)):
            link = TREE.joinpath(*package.split("."), path.relative_to(top))
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(path, link.parent))
            links[link] = path
    return links


def _sources(top: Path) -> list[Path]:
    """Python files under `top` that git tracks or would track (.gitignore'd build output, such as
    Paddle's generated daemon/_ops.py, is not ours to check)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "*.py"],
                         capture_output=True, text=True, cwd=top, check=True).stdout
    return [top / line for line in out.splitlines() if (top / line).exists()]


def run_checker(links: dict[Path, Path]) -> int:
    checker = Path(sys.executable).parent / "basedpyright"
    out = subprocess.run([str(checker), "--outputjson", "-p", str(ROOT / "pyrightconfig.json")],
                         capture_output=True, text=True, cwd=ROOT)
    try:
        report = json.loads(out.stdout)
    except json.JSONDecodeError:
        sys.stderr.write(out.stdout + out.stderr)
        return 1
    errors = 0
    for diag in report["generalDiagnostics"]:
        path = Path(diag["file"])
        real = links.get(path, path)
        line = diag["range"]["start"]["line"] + 1
        rule = f" ({diag['rule']})" if diag.get("rule") else ""
        print(f"{real.relative_to(ROOT)}:{line}: {diag['severity']}: {diag['message']}{rule}")
        errors += diag["severity"] == "error"
    summary = report["summary"]
    print(f"{summary['filesAnalyzed']} files, {errors} errors "
          f"(basedpyright {report['version']}, standard mode)")
    return 1 if errors else 0


def main() -> int:
    return run_checker(build_tree(package_dir()))


if __name__ == "__main__":
    sys.exit(main())
