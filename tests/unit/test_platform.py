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
