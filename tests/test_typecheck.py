"""The static check CI runs (scripts/typecheck.py): its path map lays the sources out as the installed
package, so `mtpserve.*` imports resolve, and an import that does not resolve is an error."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import typecheck  # noqa: E402


def test_the_path_map_mirrors_setup_pys_package_dir():
    mapping = typecheck.package_dir()
    assert mapping == {"mtpserve": "daemon", "mtpserve.ipc": "ipc", "mtpserve.config": "config"}
    links = typecheck.build_tree(mapping)
    tree = typecheck.TREE / "mtpserve"
    assert links[tree / "engine" / "engine_core.py"] == ROOT / "daemon" / "engine" / "engine_core.py"
    assert links[tree / "ipc" / "wire.py"] == ROOT / "ipc" / "wire.py"
    assert links[tree / "config" / "schema.py"] == ROOT / "config" / "schema.py"
    assert all(link.resolve() == source.resolve() for link, source in links.items())


def test_an_unresolved_import_fails_the_check(tmp_path):
    typecheck.build_tree(typecheck.package_dir())
    (tmp_path / "probe.py").write_text("from mtpserve.engine.engine_core import EngineCore\n"
                                       "import mtpserve.no_such_module\n"
                                       "core: EngineCore = 1\n")
    (tmp_path / "pyrightconfig.json").write_text(json.dumps({
        "include": ["probe.py"], "extraPaths": [str(typecheck.TREE)], "venvPath": str(ROOT),
        "venv": ".venv", "typeCheckingMode": "standard"}))
    checker = Path(sys.executable).parent / "basedpyright"
    out = subprocess.run([str(checker), "--outputjson", "-p", str(tmp_path / "pyrightconfig.json")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    rules = sorted(d.get("rule") for d in json.loads(out.stdout)["generalDiagnostics"])
    assert out.returncode != 0
    assert rules == ["reportAssignmentType", "reportMissingImports"]  # the real module resolved
