"""The house's shape, held (docs/architecture.md): no import circle, at most two imports running back up a floor, no
product module over 600 lines. Measured by tests/import_graph.py over the product code (tests left out)."""

from __future__ import annotations

import ast
import os
import pathlib
import re

import import_graph
from conftest import REPO

MAX_UPWARD = 2
MAX_MODULE_LINES = 600


def test_no_import_circle_and_floors_held():
    house = import_graph.measure()
    assert house["circles"] == [], f"import circles: {house['circles']}"
    assert len(house["upward"]) <= MAX_UPWARD, f"imports running back up a floor: {house['upward']}"


def test_no_product_module_over_600_lines():
    house = import_graph.measure()
    over = {m: n for m, n in house["module_lines"].items() if n > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_the_measure_sees_an_upward_import_and_a_circle(tmp_path):
    """The check can fail: a small tree with a lazy import up a floor and two modules importing each other."""
    (tmp_path / "parity" / "low").mkdir(parents=True)
    (tmp_path / "parity" / "__init__.py").write_text("")
    (tmp_path / "parity" / "low" / "__init__.py").write_text("")
    (tmp_path / "parity" / "low" / "a.py").write_text("from parity.low import b\n")
    (tmp_path / "parity" / "low" / "b.py").write_text("def f():\n    from parity.low import a\n    import top\n")
    (tmp_path / "top.py").write_text("from parity.low import a\n")
    house = import_graph.measure(str(tmp_path))
    assert house["circles"] == [["parity.low.a", "parity.low.b", "top"]]  # top imports a, b imports top
    assert house["upward"] == [("parity.low", "top")]
    assert house["floor"] == {"parity": 0, "parity.low": 0, "top": 1}


def test_no_sys_path_edit_anywhere():
    """A module is found because the project is installed, or loaded by its file path (importlib): no code of the
    house — product, tests, examples, tools, the scripts — puts a folder on sys.path."""
    edit = re.compile(r"sys\.path\.(insert|append|extend|remove|pop)\(|sys\.path(\[[^]]*\])? *\+?= ")
    edits = [f"{path.relative_to(REPO)}:{n}" for path in sorted(pathlib.Path(REPO).rglob("*.py"))
             if not any(part.startswith(".") for part in path.relative_to(REPO).parts)
             and path != pathlib.Path(__file__).resolve()  # (this check's own examples below)
             for n, line in enumerate(path.read_text().splitlines(), 1) if edit.search(line)]
    assert edits == []
    assert edit.search("sys.path.insert(0, here)") and edit.search("sys.path[:0] = [here]")  # the check can fail


# A framework's import names → the room under parity/frameworks/ that alone may import it; transformers' Trainer API by
# its modules and names (the rest of transformers — models, configs, tokenizers — is the harness's model library).
FRAMEWORK_IMPORTS = {"lightning": "lightning", "pytorch_lightning": "lightning", "trl": "trl", "torchtitan": "torchtitan",
                     "megatron": "megatron", "vllm": "vllm"}
TRAINER_API = {"Trainer", "TrainerCallback", "TrainingArguments", "TrainerState", "TrainerControl", "Seq2SeqTrainer"}


def framework_imports(path: str) -> list[tuple[int, str, str]]:
    """(line, module, the framework it belongs to) for each import of a framework in the file at `path`."""
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            imported = [(a.name, set()) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            imported = [(node.module, {a.name for a in node.names})]
        else:
            continue
        for module, names in imported:
            framework = FRAMEWORK_IMPORTS.get(module.split(".")[0])
            if module.split(".")[0] == "transformers" and (module.startswith(("transformers.trainer",
                                                                              "transformers.training_args"))
                                                           or names & TRAINER_API):
                framework = "transformers"
            if framework:
                found.append((node.lineno, module, framework))
    return found


def test_only_a_frameworks_room_imports_that_framework():
    """parity/frameworks/<name>/ is the only product code that imports framework <name> (a registry line and a room
    is how a framework enters: parity/frameworks/__init__.py)."""
    wrong = [f"{f}:{line} imports {module} ({framework}'s)" for f in import_graph.product_files()
             for line, module, framework in framework_imports(os.path.join(REPO, f))
             if not f.startswith(os.path.join("parity", "frameworks", framework) + os.sep)]
    assert wrong == []
    from parity.frameworks import FRAMEWORKS, registered

    assert [f.name for f in registered()] == list(FRAMEWORKS)
    assert [room for room in sorted(os.listdir(os.path.join(REPO, "parity", "frameworks")))
            if os.path.isfile(os.path.join(REPO, "parity", "frameworks", room, "__init__.py"))] == sorted(FRAMEWORKS)


def test_the_framework_rule_can_fail(tmp_path):
    """The check sees a framework imported outside its room, and transformers' Trainer API by module and by name."""
    (tmp_path / "x.py").write_text("import lightning.pytorch as pl\nfrom transformers import AutoModel, Trainer\n"
                                   "from transformers.trainer_callback import TrainerState\nimport transformers\n")
    assert framework_imports(str(tmp_path / "x.py")) == [(1, "lightning.pytorch", "lightning"),
                                                         (2, "transformers", "transformers"),
                                                         (3, "transformers.trainer_callback", "transformers")]


DOCUMENTED = ("parity", "parity.training.strategy")  # what a user's code imports: the public surface, the strategy API


def surface_imports(text: str) -> list[str]:
    """The parity modules `text` (a Python file, or a page's code) imports from."""
    return [a or b for a, b in re.findall(r"^\s*(?:from (parity[\w.]*) import|import (parity[\w.]*))", text, re.M)]


def test_the_examples_and_docs_import_only_the_public_surface():
    """The examples and the docs' code import parity's public names from `parity` itself (or a strategy's API from
    parity.training.strategy): the rooms behind it are free to move. Every public name resolves, and `import parity`
    imports no framework."""
    files = sorted(pathlib.Path(REPO, "examples").glob("*.py")) + sorted(pathlib.Path(REPO, "docs").glob("*.md"))
    wrong = [f"{f.name}: {m}" for f in files for m in surface_imports(f.read_text()) if m not in DOCUMENTED]
    assert wrong == [] and surface_imports("    from parity.recording.recorder import X\n") == ["parity.recording.recorder"]
    import parity

    assert all(getattr(parity, name) is not None for name in parity.__all__)
    assert parity.ParityLightningCallback.__module__ == "parity.frameworks.lightning.callback"


def test_an_old_name_imports_and_says_once_where_it_went():
    """A script still importing release 0.1's parity.integrations.* gets the same object, and one FutureWarning naming
    where it went (the second import says nothing)."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        from parity.integrations.transformers import ParityCallback
        from parity.integrations.transformers import ParityCallback as again
    import parity

    assert ParityCallback is again is parity.ParityCallback
    said = [str(w.message) for w in seen if issubclass(w.category, FutureWarning)]
    assert said == ["parity.integrations.transformers moved to parity.frameworks.transformers.callback: "
                    "from parity import ParityCallback"], said


ARGV_SCAN = re.compile(r'\.index\("-m"\)|"-m" in (command|argv)|endswith\("\.py"\)[^\n]*\bin (command|argv)\b|'
                       r'enumerate\((command|argv)\)')


def test_the_users_command_is_parsed_by_one_function():
    """Only parity/attaching/command.py looks through a launch command for its script or module; every other place
    asks its parse (verify_trainer's record name, the layer cut's reader, torchtitan's arguments)."""
    scanning = [f for f in import_graph.product_files() if f != os.path.join("parity", "attaching", "command.py")
                and ARGV_SCAN.search(pathlib.Path(REPO, f).read_text())]
    assert scanning == [] and ARGV_SCAN.search('next(i for i, a in enumerate(command) if a.endswith(".py"))')
    from parity.attaching.command import parse

    found = {tuple(c): (p.kind, p.entry, p.arguments, p.launcher) for c in (
        ["torchrun", "--nproc_per_node", "2", "train.py", "--lr", "1"], ["python", "-m", "torch.distributed.run",
         "--standalone", "-m", "torchtitan.train", "--module", "llama3"], ["trl", "sft", "--x", "1"])
        for p in [parse(c)]}
    assert list(found.values()) == [
        ("script", "train.py", ["--lr", "1"], ("torchrun", "--nproc_per_node", "2")),
        ("module", "torchtitan.train", ["--module", "llama3"], ("python", "-m", "torch.distributed.run", "--standalone")),
        ("program", "trl", ["sft", "--x", "1"], ())]
