"""The layout rule: analysis/ reads runs and features, so importing it loads no plugin and no framework."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = {"plugins", "timm", "torchvision", "fairseq", "mmdet"}


def test_analysis_imports_no_plugin_or_framework():
    modules = sorted(f"analysis.{path.stem}" for path in (REPO / "analysis").glob("*.py") if path.stem != "__init__")
    assert "analysis.cka" in modules
    # A fresh interpreter: this test process has long imported the frameworks.
    probe = ("import importlib, json, sys\n"
             "for name in sys.argv[1:]:\n"
             "    importlib.import_module(name)\n"
             "print(json.dumps(sorted(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", probe, *modules], cwd=REPO, capture_output=True,
                            text=True, check=True)
    loaded = json.loads(result.stdout)
    assert set(modules) <= set(loaded)
    offenders = sorted(name for name in loaded if name.split(".")[0] in FORBIDDEN)
    assert not offenders, f"importing analysis/ loads {offenders}"
