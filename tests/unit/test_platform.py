"""platform/ is a source root, never a package: the stdlib's `platform` (which torch and Ray import) must win."""

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
    from behemoth.driver.trainer import train as driver_train
    from behemoth.driver.tune import sweep as driver_sweep

    from behemoth.config import load_config as config_load_config

    assert train is driver_train and sweep is driver_sweep and behemoth.tune.sweep is driver_sweep
    assert load_config is config_load_config


def test_the_import_graph_points_down():
    """The rooms' rules (docs/architecture.md): the shared floor imports no room but models/ (below it: config
    checks model names against the registry); models/ only errors; worker/ never imports driver/ or ray.tune;
    nothing but driver/ and the package's face imports driver/."""
    import ast

    pkg = REPO / "platform" / "behemoth"
    floor = {"config", "errors", "paths", "checkpoint", "metrics", "progress", "version", "faults"}
    for path in pkg.rglob("*.py"):
        rel = path.relative_to(pkg)
        room = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
                imported.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names)
        ours = {m.split(".")[1] for m in imported if m.startswith("behemoth.")}
        if room in floor:
            assert ours <= floor | {"models"}, f"{rel} (shared floor) imports {ours - floor}"
        if room == "models":
            assert ours <= {"errors", "models"}, f"{rel} imports {ours}"
        if room == "worker":
            assert "driver" not in ours and not any(m.startswith("ray.tune") for m in imported), rel
        if room not in ("driver", "__init__", "__main__"):
            assert "driver" not in ours, f"{rel} imports the driver room"


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
