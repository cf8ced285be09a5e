"""Before verify_trainer.py --num_layers runs a command: does the command's code build its model where the hook
(layer_cut.py) can cut it? Read, not run: the Python the command starts (a script, `-m module`, or a console script
such as `trl`) and the modules of the user's own it imports, transitively (files outside the interpreter's library
and site-packages, and outside parity), are parsed for a transformers model builder: a `from_pretrained` (not a
tokenizer's, processor's or config's), `from_config`, a model class called (`…ForCausalLM(`, `AutoModel…`), parity's
own build_model, or a TRL trainer or CLI (they build a named model with from_pretrained); a module beside the script
that it names in a string (loaded with importlib) is read too. Code that holds none builds
its model some other way (a module of its own, a model unpickled whole): the cut cannot be applied, and verify_trainer
says so in one line before anything runs. Where the code cannot be found or is a library's other than TRL's (a shell script, a
binary, another launcher's console script), nothing is said here: the recorder's own check (layer_cut.recorded) refuses an uncut model in one line when the run starts.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import sysconfig
from importlib.machinery import PathFinder

from parity.attaching.command import parse

BUILDER_CLASS = re.compile(r"(ForCausalLM|LMHeadModel|ForConditionalGeneration)$|^AutoModel")
NOT_A_MODEL = re.compile(r"(Tokenizer|TokenizerFast|Processor|Config|FeatureExtractor)$")
BUILDER_CALLS = ("from_config", "_from_config", "build_model")  # build_model: parity.models.model's (the examples')
BUILDING_LIBRARIES = ("trl",)  # their trainers and CLI build a model named to them with from_pretrained


def entry(command: list[str]) -> tuple[str, str] | None:
    """("file", path) of the Python code of yours the command runs (a script, a module, a console script of your own
    package), ("library", name) for a library's module or console script, or None where it cannot be told (a shell
    script, a binary, a script that is not there)."""
    parsed = parse(command)
    if parsed.kind == "script":
        path = parsed.script_path()
        return ("file", path) if path else None
    if parsed.kind == "module":
        module = parsed.entry
    else:
        program = os.path.basename(parsed.entry)
        points = [p for p in importlib.metadata.entry_points(group="console_scripts") if p.name == program]
        module = points[0].value.split(":")[0] if points and shutil.which(parsed.entry) else None
    if module is None:
        return None
    path = module_file(module)
    return ("file", path) if path and _own(path) else ("library", module.split(".")[0])


def module_file(name: str, folder: str | None = None) -> str | None:
    """The .py file of module `name` as Python would find it from `folder` (the cwd, then sys.path), imported nowhere."""
    import sys

    path = [folder or os.getcwd(), *sys.path]
    for part in name.split(".")[:-1]:
        spec = PathFinder.find_spec(part, path)
        if spec is None or not spec.submodule_search_locations:
            return None
        path = list(spec.submodule_search_locations)
    spec = PathFinder.find_spec(name.split(".")[-1], path)
    origin = spec.origin if spec else None
    return origin if origin and origin.endswith(".py") else None


def _own(path: str) -> bool:
    """A file of the user's own code: not in the interpreter's library or site-packages, not parity's."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # parity/
    libraries = {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}
    path = os.path.realpath(path)
    return not any(path.startswith(os.path.realpath(p) + os.sep) for p in [*libraries, here])


def builds(command: list[str]) -> bool | None:
    """Whether the command's code builds a transformers model where the hook cuts it (None: its code cannot be found)."""
    found = entry(command)
    if found is None:
        return None
    kind, what = found
    if kind == "library":  # TRL's CLI builds with from_pretrained; another library's code is not read
        return True if what in BUILDING_LIBRARIES or what == "transformers" else None
    seen: set[str] = set()
    todo = [what]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        try:
            tree = ast.parse(open(path, encoding="utf-8").read(), path)
        except (OSError, SyntaxError, ValueError):
            continue
        if _has_builder(tree):
            return True
        todo += [p for p in _imported(tree, os.path.dirname(path)) if _own(p)]
    return False


def _has_builder(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if any(m.split(".")[0] in BUILDING_LIBRARIES for m in modules):
                return True
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        if name in BUILDER_CALLS or (name and BUILDER_CLASS.search(name)):
            return True
        if name == "from_pretrained" and isinstance(node.func, ast.Attribute):
            receiver = _name(node.func.value)
            if not (receiver and NOT_A_MODEL.search(receiver)):
                return True
    return False


def _name(node) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None


def _imported(tree: ast.AST, folder: str) -> list[str]:
    """The files of the modules `tree` imports: absolute imports as Python finds them from `folder` (a script's own
    folder first), relative ones from `folder`'s package."""
    files = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            files += [module_file(a.name, folder) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = os.path.join(os.path.normpath(os.path.join(folder, *[".."] * (node.level - 1))),
                                *(node.module or "").split("."))
            files += [os.path.join(base, "__init__.py"), base + ".py",
                      *(os.path.join(base, a.name + ".py") for a in node.names)]
        elif isinstance(node, ast.ImportFrom):
            files += [module_file(node.module, folder), *(module_file(f"{node.module}.{a.name}", folder)
                                                          for a in node.names)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            files.append(os.path.join(folder, node.value + ".py"))  # a module beside it, loaded by name (importlib)
    return [f for f in files if f and os.path.isfile(f)]
