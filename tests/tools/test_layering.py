"""kvrecover.tools.layering: the real package obeys the import rules, and a
fabricated package that breaks them is caught."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kvrecover
from kvrecover.tools.layering import Circle, find_circles, find_violations, main

REPO = Path(__file__).resolve().parents[2]


def write(root: Path, relative: str, source: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)


def fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "kvrecover"
    for relative in ("__init__.py", "engine/__init__.py", "worker/__init__.py",
                     "kv_transfer/__init__.py", "ops/__init__.py", "models/__init__.py",
                     "entrypoints/__init__.py", "llm.py", "config.py", "kv_layout.py"):
        write(root, relative, "")
    for relative, source in files.items():
        write(root, relative, source)
    return root


def test_kvrecover_obeys_the_layering():
    package_dir = Path(kvrecover.__file__).parent
    assert package_dir == REPO / "kvrecover"
    assert [str(v) for v in find_violations(package_dir)] == []
    assert [str(c) for c in find_circles(package_dir)] == []
    assert main([str(package_dir)]) == 0


def test_command_line_exits_0_on_the_real_package():
    result = subprocess.run([sys.executable, "-m", "kvrecover.tools.layering"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "layering ok" in result.stdout


def test_fabricated_violations_are_reported(tmp_path, capsys):
    type_hint = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    {}\n"
    root = fake_package(tmp_path, {
        "kv_transfer/bad_absolute.py": "from kvrecover.engine.request import Request\n",
        "kv_transfer/bad_lazy.py": "def f():\n    import kvrecover.worker.model_runner\n",
        "ops/bad_relative.py": "from ..worker import sampler\n",
        "ops/bad_package.py": "from kvrecover import engine\n",
        "models/bad_type_hint.py": type_hint.format(
            "from kvrecover.worker.kv_cache import allocate_kv_caches"),
        "kv_transfer/bad_else.py": ("from typing import TYPE_CHECKING\n"
                                    "if TYPE_CHECKING:\n    pass\n"
                                    "else:\n    from kvrecover.engine import block_pool\n"),
        # Type hints count too (issue 20): no TYPE_CHECKING exemption any more.
        "kv_transfer/bad_hint.py": type_hint.format("from kvrecover.engine.request import Request"),
        "worker/bad_engine.py": type_hint.format("from kvrecover.engine.scheduler import Scheduler"),
        "ops/bad_models.py": type_hint.format("from kvrecover.models.rope import RotaryEmbedding"),
        "kv_transfer/bad_sideways.py": "from kvrecover.worker.kv_cache import allocate_kv_caches\n",
        "entrypoints/bad_internal.py": "from kvrecover.engine.request import Request\n",
        "entrypoints/bad_module.py": "from kvrecover.engine import request\n",
        "entrypoints/bad_worker.py": "import kvrecover.worker.sampler\n",
        "config.py": "from kvrecover.engine import Engine\n",  # the vocabulary imports no floor
        "engine/bad_llm.py": "from kvrecover.llm import LLM\n",
    })
    found = {(v.path.name, v.line, v.imported) for v in find_violations(root)}
    assert found == {
        ("bad_absolute.py", 1, "kvrecover.engine.request.Request"),
        ("bad_lazy.py", 2, "kvrecover.worker.model_runner"),
        ("bad_relative.py", 1, "kvrecover.worker.sampler"),
        ("bad_package.py", 1, "kvrecover.engine"),
        ("bad_type_hint.py", 3, "kvrecover.worker.kv_cache.allocate_kv_caches"),
        ("bad_else.py", 5, "kvrecover.engine.block_pool"),
        ("bad_hint.py", 3, "kvrecover.engine.request.Request"),
        ("bad_engine.py", 3, "kvrecover.engine.scheduler.Scheduler"),
        ("bad_models.py", 3, "kvrecover.models.rope.RotaryEmbedding"),
        ("bad_sideways.py", 1, "kvrecover.worker.kv_cache.allocate_kv_caches"),
        ("bad_internal.py", 1, "kvrecover.engine.request.Request"),
        ("bad_module.py", 1, "kvrecover.engine.request"),
        ("bad_worker.py", 1, "kvrecover.worker.sampler"),
        ("config.py", 1, "kvrecover.engine.Engine"),
        ("bad_llm.py", 1, "kvrecover.llm.LLM"),
    }
    reasons = {v.path.name: v.reason for v in find_violations(root)}
    assert "runs back up the house" in reasons["bad_hint.py"]
    assert "beside kvrecover.worker" in reasons["bad_sideways.py"]
    assert "no internals" in reasons["bad_worker.py"]
    assert main([str(root)]) == 1
    assert "15 layering violation(s)" in capsys.readouterr().out


def test_the_roles_of_entrypoints_stand_apart(tmp_path):
    """Server and proxy share only entrypoints/openai/; that shared layer imports
    neither, and neither imports the CLI (issue 20, point 6)."""
    root = fake_package(tmp_path, {
        "entrypoints/proxy/app.py": "from kvrecover.entrypoints.server.app import read\n",
        "entrypoints/server/app.py": "import kvrecover.entrypoints.proxy.checks\n",
        "entrypoints/openai/responses.py": "from kvrecover.entrypoints.server import x\n",
        "entrypoints/server/serving.py": "from kvrecover.entrypoints.cli.main import main\n",
        # Allowed: each role uses the shared layer and itself; the CLI uses them all.
        "entrypoints/proxy/request.py": ("from kvrecover.entrypoints.openai.http import y\n"
                                         "from kvrecover.entrypoints.proxy.app import z\n"),
        "entrypoints/cli/main.py": ("from kvrecover.entrypoints.server.app import a\n"
                                    "from kvrecover.entrypoints.proxy.app import b\n"),
    })
    found = {(v.module, v.imported) for v in find_violations(root)}
    assert found == {
        ("kvrecover.entrypoints.proxy.app", "kvrecover.entrypoints.server.app.read"),
        ("kvrecover.entrypoints.server.app", "kvrecover.entrypoints.proxy.checks"),
        ("kvrecover.entrypoints.openai.responses", "kvrecover.entrypoints.server.x"),
        ("kvrecover.entrypoints.server.serving", "kvrecover.entrypoints.cli.main.main"),
    }
    reasons = {v.module: v.reason for v in find_violations(root)}
    assert "beside" in reasons["kvrecover.entrypoints.proxy.app"]


def test_an_unplaced_module_is_a_violation(tmp_path):
    root = fake_package(tmp_path, {"newcomer.py": "from kvrecover.kv_layout import x\n"})
    [violation] = find_violations(root)
    assert violation.module == "kvrecover.newcomer"
    assert "no floor in the house" in violation.reason


def test_allowed_imports_pass(tmp_path):
    root = fake_package(tmp_path, {
        "kv_transfer/ok.py": ("from __future__ import annotations\n"
                              "import typing\n"
                              "from kvrecover.kv_layout import KVCacheLayout\n"
                              "if typing.TYPE_CHECKING:\n"
                              "    from kvrecover.step_messages import SchedulerOutput\n"),
        "step_messages.py": "from kvrecover.config import X\n",
        "ops/ok.py": "from kvrecover.config import ATTENTION_BACKENDS\nimport torch\n",
        "models/ok.py": ("from kvrecover.models.rope import RotaryEmbedding\n"
                         "from kvrecover.ops.backend import KernelBackend\n"),
        # Each floor may import anything below it; the worker uses connectors.
        "worker/runner.py": ("from kvrecover.step_messages import SchedulerOutput\n"
                             "from kvrecover.kv_transfer.base import KVConnectorBase\n"
                             "from kvrecover.models.ok import RotaryEmbedding\n"),
        "engine/engine.py": "from kvrecover.worker.runner import ModelRunner\n",
        "engine/__init__.py": ("from kvrecover.engine.engine import Engine\n"
                               "__all__ = [\"Engine\"]\n"),
        "llm.py": "from kvrecover.engine.engine import Engine\n",
        "entrypoints/server.py": ("from kvrecover.llm import LLM\n"
                                  "from kvrecover.engine import Engine\n"
                                  "from kvrecover.kv_layout import KVCacheLayout\n"),
    })
    assert find_violations(root) == []
    assert find_circles(root) == []
    assert main([str(root)]) == 0


def test_circles_between_modules_and_between_floors_are_reported(tmp_path, capsys):
    root = fake_package(tmp_path, {
        # Two modules of one part that import each other (lazily, so Python allows it).
        "engine/a.py": "def f():\n    from kvrecover.engine import b\n",
        "engine/b.py": "from kvrecover.engine.a import f\n",
        # A back arrow closes a circle between floors.
        "models/m.py": "from kvrecover.ops.o import kernel\n",
        "ops/o.py": "from kvrecover.models.m import layer\n",
    })
    circles = find_circles(root)
    assert Circle(("kvrecover.engine.a", "kvrecover.engine.b")) in circles
    assert Circle(("kvrecover.models.m", "kvrecover.ops.o")) in circles
    assert Circle(("kvrecover.models", "kvrecover.ops")) in circles
    assert len(circles) == 3
    assert main([str(root)]) == 1
    out = capsys.readouterr().out
    assert "circle: kvrecover.engine.a -> kvrecover.engine.b -> kvrecover.engine.a" in out
    assert "1 layering violation(s), 3 circle(s)" in out
