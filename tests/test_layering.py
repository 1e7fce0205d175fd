"""kvrecover.tools.layering: the real package obeys the import rules, and a
fabricated package that breaks them is caught."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kvrecover
from kvrecover.tools.layering import find_violations, main

REPO = Path(__file__).resolve().parents[1]


def write(root: Path, relative: str, source: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)


def fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "kvrecover"
    for relative in ("__init__.py", "engine/__init__.py", "worker/__init__.py",
                     "kv_transfer/__init__.py", "ops/__init__.py", "models/__init__.py"):
        write(root, relative, "")
    for relative, source in files.items():
        write(root, relative, source)
    return root


def test_kvrecover_obeys_the_layering():
    package_dir = Path(kvrecover.__file__).parent
    assert package_dir == REPO / "kvrecover"
    assert [str(v) for v in find_violations(package_dir)] == []
    assert main([str(package_dir)]) == 0


def test_command_line_exits_0_on_the_real_package():
    result = subprocess.run([sys.executable, "-m", "kvrecover.tools.layering"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "layering ok" in result.stdout


def test_fabricated_violations_are_reported(tmp_path, capsys):
    root = fake_package(tmp_path, {
        "kv_transfer/bad_absolute.py": "from kvrecover.engine.request import Request\n",
        "kv_transfer/bad_lazy.py": "def f():\n    import kvrecover.worker.model_runner\n",
        "ops/bad_relative.py": "from ..worker import sampler\n",
        "ops/bad_package.py": "from kvrecover import engine\n",
        "models/bad_type_hint.py": ("from typing import TYPE_CHECKING\n"
                                    "if TYPE_CHECKING:\n"
                                    "    from kvrecover.worker.kv_cache import allocate_kv_caches\n"),
        "kv_transfer/bad_else.py": ("from typing import TYPE_CHECKING\n"
                                    "if TYPE_CHECKING:\n    pass\n"
                                    "else:\n    from kvrecover.engine import block_pool\n"),
    })
    found = {(v.path.name, v.line, v.imported) for v in find_violations(root)}
    assert found == {
        ("bad_absolute.py", 1, "kvrecover.engine.request.Request"),
        ("bad_lazy.py", 2, "kvrecover.worker.model_runner"),
        ("bad_relative.py", 1, "kvrecover.worker.sampler"),
        ("bad_package.py", 1, "kvrecover.engine"),
        ("bad_type_hint.py", 3, "kvrecover.worker.kv_cache.allocate_kv_caches"),
        ("bad_else.py", 5, "kvrecover.engine.block_pool"),
    }
    assert main([str(root)]) == 1
    assert "6 layering violation(s)" in capsys.readouterr().out


def test_allowed_imports_pass(tmp_path):
    root = fake_package(tmp_path, {
        "kv_transfer/ok.py": ("from __future__ import annotations\n"
                              "import typing\n"
                              "from kvrecover.kv_layout import KVCacheLayout\n"
                              "if typing.TYPE_CHECKING:\n"
                              "    from kvrecover.engine.request import Request\n"),
        "ops/ok.py": "from kvrecover.config import ATTENTION_BACKENDS\nimport torch\n",
        "models/ok.py": "from kvrecover.models.rope import RotaryEmbedding\n",
        # Engine and worker may import anything below them.
        "worker/runner.py": "from kvrecover.step_messages import SchedulerOutput\n",
        "engine/engine.py": "from kvrecover.worker.model_runner import ModelRunner\n",
    })
    assert find_violations(root) == []
    assert main([str(root)]) == 0
