"""The packages import along the process boundaries: the API process (api_server/) imports
nothing of the worker or the scheduler, which run in other processes; pipelines/,
serialization/ and processes/, which all three processes import, import none of the three roles.

Imports are read from the source (every `import` and `from` statement, inside functions
too), and `loom serve`'s own modules are imported to see what they pull in."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
ROLES = {"api_server", "scheduler", "worker"}

# What each package may import of the others. worker/pipeline.py drives the real Scheduler in
# one process (TextGenerationPipeline), so the worker may import the scheduler's policy.
ALLOWED = {
    "api_server": {"pipelines", "serialization", "processes"},
    "scheduler": {"pipelines", "serialization", "processes"},
    "worker": {"pipelines", "serialization", "processes", "scheduler"},
    "serialization": {"pipelines"},
    "processes": set(),
    "pipelines": set(),
}
# pipelines/pipeline.py is MAX's model contract (max.pipelines.pipeline), which a user's model
# imports from `pipelines`; it is built on the worker's paged cache and kernels, and only the
# worker imports it (`pipelines/__init__` does not, so the other processes never load it).
FILE_ALLOWED = {"pipelines/pipeline.py": {"worker"}}


def imported_packages(path: pathlib.Path) -> set[tuple[str, int]]:
    """(top-level package, line) of every absolute import in a file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {(alias.name.split(".")[0], node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.module.split(".")[0], node.lineno))
    return found


def test_the_reader_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from worker.process import run_worker\n    import scheduler\n")
    assert imported_packages(source) == {("worker", 2), ("scheduler", 3)}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_it_may(package):
    own = set(ALLOWED) - {package}
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {imported}"
             for path in sorted((ROOT / package).rglob("*.py"))
             for imported, line in sorted(imported_packages(path))
             if imported in own and imported not in ALLOWED[package]
             and imported not in FILE_ALLOWED.get(str(path.relative_to(ROOT)), ())]
    assert not wrong, "\n".join(wrong)


def test_loom_serve_loads_no_worker_scheduler_or_torch():
    """The API process spawns the roles by name: importing `loom serve` (the CLI and the
    launcher) loads neither their code nor PyTorch."""
    code = ("import sys, api_server.cli, api_server.launcher\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'worker', 'scheduler', 'torch', 'transformers'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]"


def test_pipelines_package_leaves_the_model_contract_to_the_worker():
    """`import pipelines` (every process does) loads neither the model contract nor torch."""
    code = ("import sys, pipelines\n"
            "print(sorted({'pipelines.pipeline', 'torch', 'worker'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]"
