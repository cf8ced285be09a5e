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


ROOMS = os.path.join("parity", "frameworks")


def room_reaches(path: str, room: str | None) -> list[tuple[int, str]]:
    """(line, what) for each place the module at `path`, of room `room` (parity/frameworks/<room>/), reaches into
    another room or a private name: an import of another room's module (parity.frameworks.<b>, or the room by name
    from the registry), a module path naming one (importlib's), a private name (a leading underscore) imported from
    outside its room, or read as an attribute of a name imported from outside its room. The registry
    (parity.frameworks) and its modules that are not rooms are no room's. A module in no room (`room` None) may import
    a room, never its private names."""
    own, found, imported = f"parity.frameworks.{room}", [], set()
    rooms = {d for d in os.listdir(os.path.join(REPO, ROOMS)) if os.path.isdir(os.path.join(REPO, ROOMS, d))}

    def in_room(module: str) -> bool:
        parts = module.split(".")
        return parts[:2] == ["parity", "frameworks"] and len(parts) > 2 and parts[2] in rooms

    def other_room(module: str) -> bool:
        return room is not None and in_room(module) and module.split(".")[2] != room

    def watched(module: str) -> bool:  # whose private names this module must not take
        return module.startswith("parity") if room is not None else in_room(module)

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if other_room(alias.name):
                    found.append((node.lineno, f"imports {alias.name}"))
                elif watched(alias.name) and alias.asname:
                    imported.add(alias.asname)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            outside = node.module != own and not node.module.startswith(own + ".")
            for alias in node.names:
                if other_room(node.module) or other_room(f"{node.module}.{alias.name}"):
                    found.append((node.lineno, f"imports {node.module}.{alias.name}"))
                elif outside and watched(node.module) and private(alias.name):
                    found.append((node.lineno, f"imports the private {node.module}.{alias.name}"))
                elif outside and watched(node.module):
                    imported.add(alias.asname or alias.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and other_room(node.value) and \
                re.fullmatch(r"[\w.]+", node.value):
            found.append((node.lineno, f"names the module {node.value}"))
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported and \
                private(node.attr):
            found.append((node.lineno, f"reads the private {node.value.id}.{node.attr}"))
    return sorted(found)


def room_of_file(path: str) -> str | None:
    """The room of parity/frameworks/ a product file (relative to the repository) lies in, or None."""
    parts = path.split(os.sep)
    return parts[2] if parts[:2] == ["parity", "frameworks"] and len(parts) > 3 else None


def test_no_room_reaches_into_another():
    """A room of parity/frameworks/ reaches another only through the registry (parity/frameworks/__init__.py:
    `engine`, `objective_of`, …), and takes no private name from outside itself: what two rooms share lives on a
    floor below (parity/recording/) or in a module of parity/frameworks/ that is not a room (sampling.py). No other
    product module takes a room's private name either."""
    files = import_graph.product_files()
    reaches = [f"{f}:{line} {what}" for f in files
               for line, what in room_reaches(os.path.join(REPO, f), room_of_file(f))]
    assert sum(room_of_file(f) is not None for f in files) > 20 and reaches == []


def test_the_room_rule_can_fail(tmp_path):
    """The check sees a room importing another's module (and its private hook), a private name imported from a floor
    below, a private attribute of an imported class, a room named by module path; the registry, a module of the
    frameworks package that is not a room, and the room's own modules pass. A module in no room is held to a room's
    private names only."""
    (tmp_path / "x.py").write_text(
        "import importlib\n"
        "from parity.frameworks import Refused, engine, guarded\n"
        "from parity.frameworks.sampling import Engine\n"
        "from parity.frameworks.lightning.factory import callbacks\n"
        "from parity.frameworks.transformers.callback import ParityCallback as _TrainerCallback\n"
        "from parity.frameworks import trl\n"
        "from parity.recording.recorder import _private, ParityRecorder\n"
        "import parity.frameworks.vllm.sampler\n"
        "class C:\n"
        "    _forward = _TrainerCallback._forward\n"
        "    hook = ParityRecorder._disable\n"
        "    own = Engine.__init__\n"
        "importlib.import_module('parity.frameworks.vllm.layers')\n"
        "from parity.frameworks.vllm.sampler import _plain\n")
    assert room_reaches(str(tmp_path / "x.py"), "lightning") == [
        (5, "imports parity.frameworks.transformers.callback.ParityCallback"), (6, "imports parity.frameworks.trl"),
        (7, "imports the private parity.recording.recorder._private"), (8, "imports parity.frameworks.vllm.sampler"),
        (11, "reads the private ParityRecorder._disable"), (13, "names the module parity.frameworks.vllm.layers"),
        (14, "imports parity.frameworks.vllm.sampler._plain")]
    assert room_reaches(str(tmp_path / "x.py"), None) == [
        (10, "reads the private _TrainerCallback._forward"),
        (14, "imports the private parity.frameworks.vllm.sampler._plain")]
    assert room_of_file(os.path.join(ROOMS, "trl", "objectives.py")) == "trl"
    assert room_of_file(os.path.join(ROOMS, "sampling.py")) is None


def test_the_sampler_seam_lists_each_engine_room():
    """Every engine a room writes (a subclass of parity/frameworks/sampling.py's Engine) is its room's, declared by its
    FRAMEWORK (`sampler`) and listed by the seam's registry (`engines`), which gives make_rollouts.py's --sampler
    choices; each says how it samples (`start`), reports its sampler side (a Session's `side`, its version) and
    reloads weights (`reload`) — an engine's room and its FRAMEWORKS line are all a new one touches."""
    from parity.commands.make_rollouts import build_parser
    from parity.frameworks import engine, engines
    from parity.frameworks.sampling import Engine

    written = sorted({room_of_file(f) for f in import_graph.product_files() if room_of_file(f) is not None
                      for node in ast.walk(ast.parse(open(os.path.join(REPO, f)).read()))
                      if isinstance(node, ast.ClassDef) and "Engine" in [getattr(b, "id", None) for b in node.bases]})
    assert written == sorted(engines()) == ["transformers", "vllm"]
    for name in engines():
        found = engine(name)
        assert isinstance(found, Engine) and found.name == name and found.describe
        assert all(getattr(type(found), m) is not getattr(Engine, m) for m in ("version", "start", "reload")), name
    assert next(a.choices for a in build_parser()._actions if a.dest == "sampler") == engines()


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


def _implements(cls, protocol) -> list[str]:
    """The protocol's members `cls` leaves as the protocol's own (unimplemented)."""
    members = [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]
    return [n for n in members if getattr(cls, n) is getattr(protocol, n)]


def test_every_view_of_a_sharded_model_implements_the_one_protocol():
    """One protocol (parity/training/view.py) with one set of names: the recorder's views (its table's rows), the
    frameworks' translated views and the strategies' base each implement every member. Cheap: no process group."""
    from parity.frameworks.megatron.view import MegatronView
    from parity.frameworks.torchtitan.view import TitanView
    from parity.training.dtensor_strategy import DTensorStrategy
    from parity.training.strategy import Strategy
    from parity.training.view import ShardedView
    from parity.views.table import VIEWS, view_classes

    table = view_classes()
    assert [c.__module__ for c in table] == [f"parity.views.{m}" for m, _ in VIEWS]
    views = [*table, TitanView, MegatronView, Strategy, DTensorStrategy]
    missing = {c.__name__: _implements(c, ShardedView) for c in views if _implements(c, ShardedView)}
    assert missing == {} and all(issubclass(c, ShardedView) for c in views)

    class Half(ShardedView):  # the check can fail
        def parameter_norm(self):
            return 0.0

    half = _implements(Half, ShardedView)
    assert "full_parameters" in half and "parameter_norm" not in half
    rooms = sorted(f for f in import_graph.product_files() if os.path.basename(f) == "view.py"
                   and f.startswith(os.path.join("parity", "frameworks")))
    assert rooms == [os.path.join("parity", "frameworks", r, "view.py") for r in ("megatron", "torchtitan")]


def layout_classes(path: str) -> list[str]:
    return [n.name for n in ast.walk(ast.parse(open(path).read()))
            if isinstance(n, ast.ClassDef) and "Layout" in n.name]


def test_layout_keeps_one_meaning():
    """"Layout" is parity/layout.py's (the run's TP × DP × PP placement) alone: a class named for it lives there only;
    what reads a sharded model is a view."""
    wrong = {f: layout_classes(os.path.join(REPO, f)) for f in import_graph.product_files()
             if f != os.path.join("parity", "layout.py") and layout_classes(os.path.join(REPO, f))}
    assert wrong == {} and layout_classes(os.path.join(REPO, "parity", "layout.py")) == ["Layout"]


PACKING = os.path.join("parity", "models", "packing.py")
PACKS = re.compile(r"_StridedShard\(|\.chunk\(\s*2\b|def \w*gate_up")  # writing the [gate; up] packing by hand


def test_the_gate_up_packing_is_written_once():
    """The packed layout of a fused [gate; up] tensor, whole and sharded part by part over TP, is parity/models/
    packing.py's; every module that reads, shards or fuses one imports it, none writes it again."""
    again = [f for f in import_graph.product_files() if f != PACKING and PACKS.search(pathlib.Path(REPO, f).read_text())]
    assert again == [] and PACKS.search("shards = [s.chunk(2, dim=0) for s in t.chunk(tp_size)]")  # it can fail
    users = [os.path.join("parity", *p) for p in (("strategies", "fsdp", "plans.py"),
                                                   ("strategies", "fsdp", "expert_parallel.py"),
                                                   ("strategies", "autotp", "gathers.py"),
                                                   ("frameworks", "megatron", "names.py"),
                                                   ("training", "dtensor_strategy.py"))]
    assert all("from parity.models.packing import" in pathlib.Path(REPO, f).read_text() for f in users)
