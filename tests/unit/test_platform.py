"""platform/ is a source root, never a package: the stdlib's `platform` (which torch and Ray import) must win."""

import re
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_import_platform_is_the_standard_library():
    import platform

    assert Path(platform.__file__).parent == Path(sysconfig.get_paths()["stdlib"])
    assert callable(platform.system)


def test_platform_folder_is_not_a_package():
    assert not (REPO / "platform" / "__init__.py").exists()


def test_behemoth_comes_from_platform():
    import behemoth

    assert Path(behemoth.__file__).parent == REPO / "platform" / "behemoth"


def test_the_python_api_entry_points():
    """behemoth.train, behemoth.sweep (also behemoth.tune.sweep), behemoth.load_config: the names the docs use,
    wherever the house keeps them."""
    import behemoth
    from behemoth import load_config, sweep, train
    from behemoth.driver.run.trainer import train as driver_train
    from behemoth.driver.sweep.tuner import sweep as driver_sweep

    from behemoth.job import load_config as config_load_config

    assert train is driver_train and sweep is driver_sweep and behemoth.tune.sweep is driver_sweep
    assert load_config is config_load_config


def test_the_public_face_is_typed_and_what_docs_examples_and_jobs_import():
    """Issue 68 item 4: py.typed is shipped; Task, RunSummary, SweepResult, JobConfig, the built-in tasks and cli
    are behemoth's own names (a type checker sees them through the TYPE_CHECKING imports, and `import behemoth`
    still imports neither torch nor Ray); docs, examples and jobs/*.py import only the face."""
    import re
    import subprocess
    import sys

    import behemoth
    from behemoth.driver.commands.cli import run_command
    from behemoth.driver.run.summary import RunSummary
    from behemoth.driver.sweep.results import SweepResult
    from behemoth.tasks.chat import ChatLM
    from behemoth.tasks.contract import Task
    from behemoth.tasks.image import ImageClassification

    assert (REPO / "platform" / "behemoth" / "py.typed").is_file()
    import tomllib

    shipped = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["behemoth"]
    assert "py.typed" in shipped
    # (and KubeRay's CRD schemas, which check-cluster reads from the installed package)
    assert "driver/commands/*.json.gz" in shipped
    assert list((REPO / "platform" / "behemoth" / "driver" / "commands").glob("kuberay_crds_*.json.gz"))
    assert (behemoth.Task, behemoth.RunSummary, behemoth.SweepResult, behemoth.ImageClassification, behemoth.ChatLM,
            behemoth.cli) == (Task, RunSummary, SweepResult, ImageClassification, ChatLM, run_command)
    assert set(behemoth.__all__) <= set(dir(behemoth)) | set(behemoth._LAZY)
    fresh = subprocess.run([sys.executable, "-c", "import sys, behemoth; print('torch' in sys.modules, 'ray' in "
                            "sys.modules)"], capture_output=True, text=True, check=True, cwd=REPO)
    assert fresh.stdout.split() == ["False", "False"]
    inner = re.compile(r"(?:from|import) behemoth\.(?:driver|tasks|data|worker|storage|models|hosts|tracking)\b|"
                       r"`behemoth\.tasks\.")
    for path in [*REPO.glob("docs/*.md"), *REPO.glob("examples/*.py"), *REPO.glob("jobs/*.py"), REPO / "README.md"]:
        assert not inner.search(path.read_text()), f"{path.relative_to(REPO)} imports behind the face"


# What each room may import of behemoth (docs/architecture.md, "The house"): arrows point down only. The package
# floor (__init__, __main__ and the modules every room needs) is listed module by module.
ROOM_IMPORTS = {
    "errors": set(), "version": set(), "metrics": set(), "progress": set(), "ray_internals": set(),
    "storage": {"errors"},
    "models": {"errors"},
    "config": {"errors", "models", "storage"},
    "hosts": {"errors", "storage", "ray_internals"},
    "data": {"errors", "config", "progress", "storage", "ray_internals"},
    "tracking": {"errors", "config", "metrics", "storage", "ray_internals"},
    "tasks": {"errors", "config", "models", "storage", "data", "hosts", "metrics"},
    "job": {"errors", "config", "tasks"},
    "checkpoints": {"errors", "config", "models", "storage", "hosts", "metrics"},
    "worker": {"errors", "config", "models", "storage", "data", "hosts", "metrics", "tasks", "job", "checkpoints"},
}
FACE = {"__init__", "__main__", "driver"}  # may import anything


def _imports_of(path) -> set[str]:
    import ast

    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    return imported


def test_the_import_graph_points_down():
    """Every room imports only the rooms below it (ROOM_IMPORTS); a room or floor module the table does not know
    fails too, so a new one is placed on purpose. worker/ never imports ray.tune or the driver."""
    pkg = REPO / "platform" / "behemoth"
    for path in pkg.rglob("*.py"):
        rel = path.relative_to(pkg)
        room = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if room in FACE:
            continue
        assert room in ROOM_IMPORTS, f"{rel}: a room (or floor module) the house does not know: place it"
        ours = {m.split(".")[1] for m in _imports_of(path) if m.startswith("behemoth.")} - {room}
        assert ours <= ROOM_IMPORTS[room], f"{rel} ({room}) imports {ours - ROOM_IMPORTS[room]}"


def _local_or_uri_decisions(source: str) -> list[str]:
    """The spellings of the local-or-URI decision in a source: `is_uri`, pyarrow's `LocalFileSystem`, and a
    string test for a scheme (`"://" in path`, either quote, `not in` too)."""
    return re.findall(r"""\bis_uri\b|\bLocalFileSystem\b|['"]://['"]\s+(?:not\s+)?in\b""", source)


def test_local_or_uri_is_decided_in_the_storage_room_only():
    """Issue 68 item 2: a path is local or a URI for storage/ alone to say; every other room asks its handle
    (storage/store.py: Store's verbs, or `is_local` where the question is whether a path may be looked at on
    disk), so the two arms of that choice live in one room."""
    pkg = REPO / "platform" / "behemoth"
    assert _local_or_uri_decisions('if is_uri(p) or "://" in q or isinstance(fs, pyarrow.fs.LocalFileSystem):') \
        == ["is_uri", '"://" in', "LocalFileSystem"]  # the check's own check
    found = [f"{path.relative_to(pkg)}: {spelling}" for path in sorted(pkg.rglob("*.py"))
             if path.relative_to(pkg).parts[0] != "storage" for spelling in _local_or_uri_decisions(path.read_text())]
    assert found == []


def _place_questions(source: str) -> list[str]:
    """A handle asked what kind of place it is (`.is_local`, or the `.can_append` / `.local_path()` it had), or a
    filesystem resolved by hand (`filesystem(`)."""
    return re.findall(r"\.is_local\b|\.can_append\b|\.local_path\(|\bfilesystem\(", source)


# The files outside storage/ that may ask a Store whether its place is a path on a file system, and why: each
# needs what only a file system gives (memory-mapping, appending, renaming under a lock, a folder that a tool writes
# into) or says what a path means on a cluster. Reading, writing, listing, copying and opening never ask: Store's,
# RunStore's and model_copy's verbs choose. A file added here must say why a verb cannot do.
ASKS_WHETHER_A_PATH = {
    "data/image/image_config.py": "the decoded cache is a folder on each node's own disk, memory-mapped (a URI refused)",
    "data/image/images.py": "the kept listing of an image folder lives beside the decoded cache, in a local folder",
    "data/image/image_cache.py": "data.cache auto: no decoded cache for a URI cache_dir (the same reason)",
    "data/token_store.py": "a folder's shards are memory-mapped, a URI's read by range",
    "tracking/records.py": "a local log grows in place; an object store's is written in parts, listed back",
    "tracking/mlflow_run.py": "a folder is MLflow's file store (file://); anything else is a server's URI as given",
    "tracking/wandb_run.py": "W&B writes its files into a folder: the run's where it is one, else this machine's",
    "driver/sweep/config.py": "a sweep's own files are Tune's, in a folder (an object store is refused, said why)",
    "driver/commands/node_check.py": "the paths each node must hold on its own disk (a URI every node reaches)",
    "driver/commands/cluster_check.py": "advice: a local storage_path on a multi-node cluster is each node's own",
    "driver/commands/kuberay_check.py": "the same advice per pod; the run's records read offline, from a path only",
    "driver/commands/data_bench.py": "its figures are kept beside a local cache, replaced under a file lock",
    "driver/commands/export.py": "save_pretrained writes a local folder: a URI for --out is refused, said why",
}


def test_where_bytes_live_is_the_storage_rooms_to_say():
    """Issue 77 item 1: no room but storage/ asks what kind of place it holds, except where the answer is a
    feature's precondition (ASKS_WHETHER_A_PATH, each with its reason): the rooms that write, open, keep and
    delete checkpoints (checkpoints/, hosts/) hold a storage/run_store.RunStore (in place or staged, claimed by
    mkdir or not, opened where it lies or by range are decided there); a model's folder, a token cache, a run's
    profile and records are read and written through Store's and model_copy's verbs."""
    pkg = REPO / "platform" / "behemoth"
    assert _place_questions("Store(p).is_local or s.can_append or s.local_path() or filesystem(x)") == [
        ".is_local", ".can_append", ".local_path(", "filesystem("]  # the check's own check
    asking = {str(path.relative_to(pkg)): _place_questions(path.read_text()) for path in sorted(pkg.rglob("*.py"))
              if path.relative_to(pkg).parts[0] != "storage"}
    found = [f"{name}: {q}" for name, qs in asking.items() for q in qs
             if q != ".is_local" or name not in ASKS_WHETHER_A_PATH]
    assert found == []
    assert sorted(name for name, qs in asking.items() if qs) == sorted(ASKS_WHETHER_A_PATH)  # none listed idly


def test_the_worker_room_reaches_checkpoints_through_their_face_only():
    """Issue 68 item 2: checkpointing is one room whose face (checkpoints/__init__.py: save, restore, latest,
    verify) is all the worker room, the loop above all, talks to: no worker/ file imports a module behind it."""
    pkg = REPO / "platform" / "behemoth"
    found = [f"{path.relative_to(pkg)}: {m}" for path in sorted((pkg / "worker").rglob("*.py"))
             for m in sorted(_imports_of(path)) if m.startswith("behemoth.checkpoints.")
             and m.split(".")[2] in {f.stem for f in (pkg / "checkpoints").glob("*.py")}]
    assert found == []
    assert "behemoth.checkpoints" in _imports_of(pkg / "worker" / "loop.py")  # the check sees the loop's import


def test_the_worker_side_never_imports_ray():
    """worker/, checkpoints/ and tasks/ reach Ray only through their host (hosts/): no `import ray` or `from ray...`
    in any of their files, at module level or inside a function (issue 57)."""
    pkg = REPO / "platform" / "behemoth"
    found = [f"{path.relative_to(pkg)}: {m}" for room in ("worker", "checkpoints", "tasks")
             for path in sorted((pkg / room).rglob("*.py"))
             for m in sorted(_imports_of(path)) if m == "ray" or m.startswith("ray.")]
    assert found == []


def test_ray_trains_controller_side_imports_no_torch():
    """Ray Train's controller (a new process per fit) unpickles the trainer's backend config and runs behemoth's
    callbacks; none of it may import torch (1.5-2 s on the path of every fit's start, BENCHMARKS.md "Where a
    tiny fit's time goes"): the torch backend config (ray_internals/torch_backend.py), the modules of every
    controller callback and the TensorBoard writer, in a fresh interpreter."""
    import subprocess
    import sys

    script = """
import pickle, sys, tempfile
import behemoth.tracking.callbacks, behemoth.hosts.lease_fence, behemoth.hosts.rescue_callback
import behemoth.driver.ray_cluster.failure_policy, behemoth.driver.ray_cluster.placement_cleaner
import behemoth.driver.sweep.trial  # (a sweep's trial through Ray Train: its EvalReportCallback)
from behemoth.ray_internals.torch_backend import LazyTorchConfig
from behemoth.tracking.tensorboard import ScalarWriter
config = pickle.loads(pickle.dumps(LazyTorchConfig(backend="gloo")))
config.backend_cls(), config.train_func_context, config.framework, config.to_dict()
with ScalarWriter(tempfile.mkdtemp(), purge_step=3) as writer:
    writer.add_scalar("train/loss", 1.0, 3)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout[:500]


def test_the_lazy_torch_config_has_ray_torch_configs_fields_and_defaults():
    """LazyTorchConfig stands for Ray's TorchConfig (TorchTrainer sets its backend; Ray Train's state reads
    to_dict): on a Ray upgrade that adds or renames a field, this fails."""
    import dataclasses

    from ray.train.torch import TorchConfig

    from behemoth.ray_internals.torch_backend import LazyTorchConfig

    def fields(cls) -> list:
        return [(f.name, f.default) for f in dataclasses.fields(cls)]

    assert fields(LazyTorchConfig) == fields(TorchConfig)
    assert LazyTorchConfig(backend="gloo").to_dict() == TorchConfig(backend="gloo").to_dict()
    assert LazyTorchConfig().framework == TorchConfig().framework


def _private_ray_names(source: str) -> list[str]:
    """Ray's private APIs a source uses: imports of `ray.*._x` modules (`_internal`, `_private`, `_common`, ...)
    or of `_x` names from Ray, Ray's generated protobufs, and private module names in string literals (a
    logger's name)."""
    import ast
    import re

    private = re.compile(r"^ray(\.\w+)*\.(_\w+|core\.generated)(\.|$)")
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ray":
            found += [node.module] if private.match(node.module) else []
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if private.match(a.name)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and private.match(node.value):
            found.append(node.value)
    return found


def test_rays_private_apis_are_used_in_one_folder_read_against_the_installed_ray():
    """A Ray upgrade touches one folder: nothing outside ray_internals/ uses a private Ray name, each of its
    modules says which Ray it was read against, and that is the installed Ray's release line (issue 57)."""
    import ray

    from behemoth import ray_internals

    pkg = REPO / "platform" / "behemoth"
    outside = [f"{path.relative_to(pkg)}: {name}" for path in sorted(pkg.rglob("*.py"))
               if path.relative_to(pkg).parts[0] != "ray_internals" for name in _private_ray_names(path.read_text())]
    assert outside == []
    for module in (pkg / "ray_internals").glob("*.py"):
        if module.stem != "__init__":
            assert f"Read against Ray {ray_internals.READ_AGAINST}" in module.read_text(), module.name
    line = ray_internals.READ_AGAINST.rsplit(".", 1)[0]
    assert ray.__version__.rsplit(".", 1)[0] == line, f"installed Ray {ray.__version__}: re-read ray_internals/"
    assert f"ray[train,tune,data,default]>={line},<" in (REPO / "pyproject.toml").read_text()


def test_the_private_ray_check_sees_every_spelling():
    for source in ("from ray._private import state", "import ray._private.worker", "from ray.core.generated import gcs_pb2",
                   "from ray.train.v2._internal.callbacks import X", "from ray.data import _internal",
                   "logging.getLogger('ray._private.authentication')"):
        assert _private_ray_names(source), source
    for source in ("import ray.train", "from ray.train import Checkpoint", "logging.getLogger('ray.data')"):
        assert not _private_ray_names(source), source


def test_the_loop_file_and_every_function_stay_short():
    """The house's reading rules (issue 18): the training loop's file reads top to bottom in <= 300 lines, and
    no function in the package is over ~60 lines (62: a signature and a docstring's tail of slack)."""
    import ast

    package = REPO / "platform" / "behemoth"
    assert len((package / "worker" / "loop.py").read_text().splitlines()) <= 300
    long = [f"{path.relative_to(package)}:{node.name} {node.end_lineno - node.lineno + 1} lines"
            for path in sorted(package.rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 62]
    assert long == [], "split these functions"


def _module_graph() -> dict[str, set[str]]:
    """behemoth's modules -> the behemoth modules each imports: import statements anywhere in the file, and
    import paths in string literals ("behemoth.tasks.image:ImageClassification", imported by importlib)."""
    import ast
    import re

    pkg = REPO / "platform" / "behemoth"
    modules = {}
    for path in pkg.rglob("*.py"):
        parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    literal = re.compile(r"^behemoth(\.[a-z_]+)+(:[A-Za-z_]+)?$")

    def imported_by(node) -> list[str]:
        if isinstance(node, ast.ImportFrom) and node.module:  # from a import b: the module a.b where it is one
            return [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names]
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and literal.match(node.value):
            return [node.value.split(":")[0]] if node.value.split(":")[0] in modules else []
        return []

    graph = {}
    for name, path in modules.items():
        found = (m for node in ast.walk(ast.parse(path.read_text())) for m in imported_by(node))
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, found = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_counting_importlib_edges():
    """No two modules, and no two rooms, import each other, counting the modules a registry names by import
    path (the task registry, the model registry, the warm-up's module lists): config knows no task, a task
    knows config (issue 36)."""
    graph = _module_graph()
    assert "behemoth.tasks.image" in graph["behemoth.tasks.registry"]  # the importlib edges are seen
    assert _circles(graph) == []
    rooms: dict[str, set[str]] = {}
    for module, imported in graph.items():
        room = module.split(".")[1] if "." in module else module
        rooms.setdefault(room, set()).update(m.split(".")[1] for m in imported if "." in m)
    assert _circles({r: out - {r} for r, out in rooms.items()}) == []
    assert not any(m.startswith(("behemoth.tasks", "behemoth.job")) for m in graph["behemoth.config"])


def test_one_place_reports_to_ray_train():
    """Every report (metrics, and a checkpoint with its upload) goes through one call of ray.train.report
    (hosts/ray_train.py, Ray Train's host of the worker room; saver.send_report is the room's one report), so what
    a report carries and how is decided in one place (issue 36)."""
    import ast

    pkg = REPO / "platform" / "behemoth"
    calls = [f"{path.relative_to(pkg)}:{node.lineno}" for path in sorted(pkg.rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text())) if _reports_to_ray_train(node)]
    assert len(calls) == 1 and calls[0].startswith("hosts/ray_train.py:"), calls


def _reports_to_ray_train(node) -> bool:
    """A call of ray.train.report however it is spelt (`ray.train.report(...)`, `train.report(...)` after `from
    ray import train`), or an import of the function itself (`from ray.train import report [as r]`: every call
    of that name reports)."""
    import ast

    if isinstance(node, ast.Call):
        return ast.unparse(node.func) in ("ray.train.report", "train.report")
    return (isinstance(node, ast.ImportFrom) and node.module in ("ray.train", "ray.train.v2.api.train_fn_utils")
            and any(alias.name == "report" for alias in node.names))


def test_the_report_check_sees_every_spelling():
    """The check above, on code that reports to Ray Train in each way it can be written."""
    import ast

    for source in ("ray.train.report(m)", "train.report(m)", "from ray.train import report",
                   "from ray.train import report as send", "from ray.train import Checkpoint, report"):
        assert any(_reports_to_ray_train(n) for n in ast.walk(ast.parse(source))), source
    for source in ("tune.report(m)", "from ray.tune import report", "from ray.train import Checkpoint"):
        assert not any(_reports_to_ray_train(n) for n in ast.walk(ast.parse(source))), source


_MARKS_PLUGIN = """
import json, os

def pytest_collection_finish(session):
    with open(os.environ["MARKS_OUT"], "w") as out:
        json.dump({item.nodeid: sorted(m.name for m in item.iter_markers()) for item in session.items}, out)
"""


def test_the_quick_tier_runs_every_unit_test_and_only_the_end_to_end_tests_marked_quick(tmp_path):
    """`./run.sh test` (options only: its two parts, the unit tests in several processes, then the end-to-end
    ones), run here with --collect-only in a stand-in virtual environment: of tests/integration/ it takes exactly
    the tests marked quick (conftest marks every test there integration, whatever its module says: a new
    end-to-end test lands in the full tier), of tests/unit/ every test, and every test of the suite is in one of
    the two; the capabilities the quick tier checks end to end (each quick test's marker comment names its own)
    are all there."""
    import json
    import os
    import subprocess
    import sys

    from conftest import stand_in_venv

    venv = stand_in_venv(tmp_path)  # (its stamp differs: run.sh "installs" with its pip, which does nothing)
    (tmp_path / "marks_plugin.py").write_text(_MARKS_PLUGIN)
    env = {**os.environ, "BEHEMOTH_VENV": str(venv), "MARKS_OUT": str(tmp_path / "marks.json"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    # every test with its markers (one collection of the whole suite), beside run.sh's two (~8 s apiece, 2 cores)
    every = subprocess.Popen([sys.executable, "-m", "pytest", "--collect-only", "-q", "-pno:cacheprovider",
                              "-pmarks_plugin"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tier = subprocess.run([str(REPO / "run.sh"), "test", "--collect-only", "-q", "-pno:cacheprovider"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    said_every = every.communicate(timeout=300)[0]
    assert every.returncode == 0, said_every[-3000:]
    assert tier.returncode == 0, tier.stdout[-3000:] + tier.stderr[-3000:]
    quick = [line for line in tier.stdout.splitlines() if "::" in line]
    marks = json.loads((tmp_path / "marks.json").read_text())
    unit = {t for t in marks if t.startswith("tests/unit/")}
    marked = {t for t in marks if t.startswith("tests/integration/") and "quick" in marks[t]}
    assert marked and set(marks) == unit | {t for t in marks if t.startswith("tests/integration/")}
    assert len(quick) == len(set(quick)) and set(quick) == unit | marked
    assert [t.split("/")[1] for t in quick] == ["unit"] * len(unit) + ["integration"] * len(marked)  # in turn
    said = " ".join(re.findall(r"@pytest\.mark\.quick  # quick tier: (.*)",
                               "".join((REPO / t.split("::")[0]).read_text() for t in sorted(marked))))
    # the README's list of what the quick tier checks end to end: each one is a quick test's own
    listed = re.search(r"End to end, the quick tier checks: (.*?)\.\n\n", (REPO / "README.md").read_text(), re.S)
    capabilities = [c.strip() for c in " ".join(listed.group(1).split()).split(";")]
    assert len(capabilities) >= 7, capabilities
    for capability in capabilities:
        assert capability in said, capability


def test_every_rooms_docstring_names_its_modules():
    """Issue 68 item 4: each room's (and sub-room's) __init__ docstring names every module and sub-room it holds,
    so a module added without a word in its room's docstring fails here (seven of twelve disagreed with their
    code); and every module its list names is there."""
    import ast

    pkg = REPO / "platform" / "behemoth"
    unnamed = {}
    for init in pkg.glob("**/__init__.py"):
        room = init.parent
        if room == pkg:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        held = [f.stem for f in room.glob("*.py") if f.stem != "__init__"]
        held += [d.name for d in room.iterdir() if (d / "__init__.py").is_file()]
        missing = sorted(m for m in held if not re.search(rf"\b{m}\b", doc))
        if missing:
            unnamed[str(room.relative_to(pkg))] = missing
        # and the other way (issue 77 item 5): a name the list gives as a module (a bullet's first `name`, or a
        # `name`: with its account) is one the room holds, so a module moved or renamed leaves no stale entry
        listed = (re.findall(r"(?m)^\s*- `([a-z_0-9]+)(?:\.py|/)?`", doc)
                  + re.findall(r"`([a-z_0-9]+)(?:\.py|/)?`:", doc))
        stale = sorted({m for m in listed if m not in held})
        if stale:
            unnamed[f"{room.relative_to(pkg)} (not there)"] = stale
    assert unnamed == {}


def _documented_modules() -> set[str]:
    """The package's modules a layout must name: every .py file under platform/behemoth, by its path there,
    except a room's __init__.py that holds only a docstring (the room is named by its folder)."""
    import ast

    pkg = REPO / "platform" / "behemoth"
    found = set()
    for path in pkg.rglob("*.py"):
        body = ast.parse(path.read_text()).body
        docstring_only = all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)
        if path.name == "__init__.py" and path.parent != pkg and docstring_only:
            continue
        found.add(str(path.relative_to(pkg)))
    return found


def _layout_lines(doc: str, heading: str) -> list[str]:
    """The modules a doc's layout names: in the code blocks under `heading` (to the next heading of its level
    or higher), each line that starts (after its indent) with a module path relative to platform/behemoth."""
    import re

    text = (REPO / doc).read_text()
    level = heading.split(" ")[0]
    start = text.index(f"\n{heading}\n")
    ends = [m.start() for m in re.finditer(r"\n(#{1,%d}) " % len(level), text) if m.start() > start]
    section = text[start:ends[0] if ends else len(text)]
    blocks = re.findall(r"```\n(.*?)```", section, flags=re.S)
    return [m.group(1) for block in blocks for line in block.splitlines()
            if (m := re.match(r"\s*((?:[a-z_]+/)*[a-z_0-9]+\.py)\s", line + " "))]


def test_the_architecture_doc_names_every_module_once():
    """docs/architecture.md's module list names every module of the package, each on a line of its own with
    what it holds, and nothing that is not there: adding, moving or removing a module without it fails here
    (issue 57). (The README is the front door: it points there, issue 68.)"""
    modules = _documented_modules()
    assert "storage/checkpoint.py" in modules and "storage/__init__.py" not in modules  # the helper's own check
    assert "docs/architecture.md" in (REPO / "README.md").read_text().split("## Layout")[1]
    for doc, heading in (("docs/architecture.md", "## Every module"),):
        named = _layout_lines(doc, heading)
        twice = sorted({m for m in named if named.count(m) > 1})
        assert twice == [], f"{doc}: named more than once: {twice}"
        assert sorted(modules - set(named)) == [], f"{doc}: modules it does not name"
        assert sorted(set(named) - modules) == [], f"{doc}: names modules that are not there"


# One name, one meaning (issue 68): a module's name may recur only as the same thing seen from another room (the
# model of a workload and its task, a lane's driver side and its host, ...). run.py (three meanings), report.py
# and train.py (two each) were renamed; a new name twice fails until it is placed here on purpose.
COUNTERPARTS = {"causal_lm": {"models", "tasks"}, "chat": {"data/chat", "tasks"}, "contract": {"hosts", "tasks"},
                "lane": {"hosts", "driver/sweep"}, "registry": {"models", "tasks"},
                "preference": {"data/chat", "tasks"}}


def test_no_two_modules_share_a_name_with_different_meanings():
    pkg = REPO / "platform" / "behemoth"
    rooms: dict[str, set[str]] = {}
    for path in pkg.rglob("*.py"):
        if path.name != "__init__.py" and path.parent != pkg:
            rooms.setdefault(path.stem, set()).add(str(path.parent.relative_to(pkg)))
    shared = {name: where for name, where in rooms.items() if len(where) > 1}
    assert shared == {k: v for k, v in COUNTERPARTS.items() if len(v) > 1}


def test_every_module_path_the_docs_and_docstrings_name_exists():
    """A module named by its path in a docstring, a comment or docs/ (`driver/run/summary.summarise`,
    `hosts/faults.py`) is one that exists: moving modules between rooms left four such names pointing at nothing.
    (data/, models/ and config/ are also folders of a user's, so only their `.py` names are checked.)"""
    pkg = REPO / "platform" / "behemoth"
    rooms = "driver|worker|tracking|storage|tasks|hosts|checkpoints|ray_internals|config|data|models"
    named = re.compile(r"(?<![\w./-])((?:" + rooms + r")(?:/[a-z_0-9]+)+(?:\.py)?)(?![\w/-])")
    texts = [*pkg.rglob("*.py"), *(REPO / "docs").glob("*.md"), REPO / "README.md"]
    missing = set()
    for text in texts:
        for ref in named.findall(text.read_text()):
            if ref.split("/")[0] in ("data", "models", "config") and not ref.endswith(".py"):
                continue
            if not ((pkg / ref).exists() or (pkg / ref).with_suffix(".py").exists()):
                missing.add(f"{text.relative_to(REPO)}: {ref}")
    assert not missing, sorted(missing)


def test_the_command_line_is_a_table():
    """Issue 77 item 4: cli.py lists the commands (COMMANDS); each command's module adds its own parser and holds
    the handler its arguments run: cli.py declares no argument but --version, every module of driver/commands/
    that adds a command is in the table, and every command (and `data`'s every subcommand) has its handler."""
    import argparse
    import ast

    from behemoth.driver.commands import cli

    folder = REPO / "platform" / "behemoth" / "driver" / "commands"
    declared = [ast.unparse(node.args[0]) for node in ast.walk(ast.parse((folder / "cli.py").read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"]
    assert declared == ["'--version'"], declared
    adding = {path.stem for path in folder.glob("*.py") if "\ndef add_command(" in path.read_text()}
    assert adding == {module.__name__.rsplit(".", 1)[1] for module in cli.COMMANDS}

    def handled(parser: argparse.ArgumentParser, where: str) -> list[str]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return [] if callable(parser.get_default("handler")) else [where]
        return [name for s in subs for n, p in s.choices.items() for name in handled(p, f"{where} {n}")]

    assert handled(cli.build_parser(), "behemoth") == []
