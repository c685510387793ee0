"""`--custom-architectures` (MAX's flag): a user's own `PipelineModel` subclasses, imported from
their own files, serving the checkpoints whose config.json names their architecture
(`architectures[0]`), before the built-in ones.

A spec is one of
- `module:Class` or `path/to/file.py:Class`: that class, serving the architecture its
  `architecture` attribute names (any checkpoint when it names none);
- a package, as a directory or a module name, whose `__init__` lists
  `ARCHITECTURES = [SupportedArchitecture(name=..., pipeline_model=Class, task=...)]` (MAX's form).

The user's files need not be on sys.path. This module imports no torch: the CLI checks what can
be told without running the user's code (`check_spec`); the worker imports them
(`load_architectures`), and a spec that fails there fails `loom serve` at start.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys

from pipelines.status import PipelineTask


class CustomArchitectureError(ValueError):
    pass


def check_spec(spec: str) -> None:
    """What the CLI can check without importing: the file, directory or module exists."""
    target, _ = _split(spec)
    if _is_path(target):
        if not os.path.exists(target):
            raise CustomArchitectureError(f"--custom-architectures {spec}: no such file or "
                                          f"directory {target!r}")
    elif _find_module(target) is None:
        raise CustomArchitectureError(f"--custom-architectures {spec}: no module named "
                                      f"{target!r} (a file works too: path/to/file.py:Class)")


def load_architectures(specs: tuple[str, ...]) -> list:
    """The SupportedArchitectures (pipelines.pipeline's) of every spec, in order: the first
    that serves a checkpoint wins."""
    return [arch for spec in specs for arch in _load(spec)]


def find_architecture(archs: list, name: str):
    """The first of `archs` that serves checkpoints of architecture `name`, or None."""
    return next((a for a in archs if a.name in (name, None)), None)


def _load(spec: str) -> list:
    from pipelines.pipeline import SupportedArchitecture  # (torch: the worker's)

    target, class_name = _split(spec)
    try:
        module = _import(target)
    except CustomArchitectureError:
        raise
    except Exception as exc:  # the user's code raised: say where
        raise CustomArchitectureError(f"--custom-architectures {spec}: importing {target} "
                                      f"failed: {type(exc).__name__}: {exc}") from exc
    if class_name is not None:
        cls = getattr(module, class_name, None)
        if cls is None:
            raise CustomArchitectureError(f"--custom-architectures {spec}: {target} has no "
                                          f"{class_name}")
        _check_model_class(spec, cls)
        # (No `architecture` attribute: it serves any checkpoint.)
        return [SupportedArchitecture(getattr(cls, "architecture", None), cls)]
    archs = getattr(module, "ARCHITECTURES", None)
    if not isinstance(archs, (list, tuple)) or not archs:
        raise CustomArchitectureError(f"--custom-architectures {spec}: its __init__ has no "
                                      f"ARCHITECTURES = [SupportedArchitecture(...)] list "
                                      f"(or name a class: {spec}:Class)")
    for arch in archs:
        if not isinstance(arch, SupportedArchitecture):
            raise CustomArchitectureError(f"--custom-architectures {spec}: ARCHITECTURES holds "
                                          f"{arch!r}, not a SupportedArchitecture")
        if arch.task is not PipelineTask.TEXT_GENERATION:
            raise CustomArchitectureError(f"--custom-architectures {spec}: {arch.name} is a "
                                          f"{arch.task.value} model; custom architectures "
                                          f"generate text")
        _check_model_class(spec, arch.pipeline_model)
    return list(archs)


def _check_model_class(spec: str, cls) -> None:
    from pipelines.pipeline import PipelineModel

    if not (isinstance(cls, type) and issubclass(cls, PipelineModel)):
        name = getattr(cls, "__name__", repr(cls))
        raise CustomArchitectureError(f"--custom-architectures {spec}: {name} is not a "
                                      f"subclass of pipelines.pipeline.PipelineModel")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise CustomArchitectureError(f"--custom-architectures {spec}: {cls.__name__} does "
                                      f"not implement {missing}")


def _find_module(name: str):
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:  # (a parent package missing)
        return None


def _split(spec: str) -> tuple[str, str | None]:
    target, sep, class_name = spec.rpartition(":")
    return (target, class_name) if sep else (spec, None)


def _is_path(target: str) -> bool:
    return target.endswith(".py") or os.sep in target or os.path.isdir(target)


def _import(target: str):
    if not _is_path(target):
        return importlib.import_module(target)
    path = os.path.abspath(target)
    if os.path.isdir(path):  # a package: relative imports inside it work
        init = os.path.join(path, "__init__.py")
        if not os.path.isfile(init):
            raise CustomArchitectureError(f"--custom-architectures {target}: a package "
                                          f"directory needs an __init__.py")
        return _exec_module(os.path.basename(path), init, [path])
    if not os.path.isfile(path):
        raise CustomArchitectureError(f"--custom-architectures {target}: no such file")
    return _exec_module(os.path.splitext(os.path.basename(path))[0], path, None)


def _exec_module(name: str, path: str, package_path: list[str] | None):
    """The file imported as module `name` (another name if that one is taken)."""
    unique, n = name, 1
    while unique in sys.modules:
        unique, n = f"{name}_{n}", n + 1
    spec = importlib.util.spec_from_file_location(unique, path,
                                                  submodule_search_locations=package_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[unique] = module  # (before it runs: dataclasses and relative imports look)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[unique]
        raise
    return module
