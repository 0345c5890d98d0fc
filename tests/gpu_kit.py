"""The GPU kit: what the lent GPU machine's image lacks for behemoth and its GPU tier, built here as wheels, and
a rehearsal of its install (`./run.sh gpu-kit`).

The lent machine reaches no package index. Its image's `python3` (3.12, x86_64) holds torch, transformers,
peft, pyarrow, pytest, Pillow and the rest of IMAGE_HAS below, but not Ray, simplejpeg, pydantic, jsonschema or
datasets. This builds, in a git-ignored folder (default `gpu-kit/`):

  gpu-kit/wheels/*.whl   every distribution behemoth's imports need that the image lacks, for CPython 3.12 on
                         manylinux x86_64: the closure of behemoth's requirements (pyproject.toml, Ray's extras
                         train, tune and data) over their Requires-Dist, stopping at what the image has; Ray's
                         wheel trimmed of what behemoth never imports (the Java jars, RLlib, Serve, Ray LLM, the
                         dashboard's browser build), its RECORD rewritten to match
  gpu-kit/kit.json       what was put in and why, with sizes

`tests/gpu_kit.sh` installs them there (`pip install --no-index --no-deps --target`) and runs the tier. The kit
and the working tree travel together: under the 64 MiB a call may carry (checked here).

    python tests/gpu_kit.py build [--out gpu-kit]
    python tests/gpu_kit.py rehearse [--kit gpu-kit] [--no-dry-run]

`rehearse`: a fresh Python 3.12 environment (pyenv's, or BEHEMOTH_PY312) holding the image's packages that
Ray and behemoth's data side import (not torch: PyPI's Linux torch is a CUDA build of several GB), the kit
installed into it exactly as on the lent machine (`--no-index --no-deps --target`), then Ray started there with
a Ray Data pipeline and Ray Tune and Train imported; then the device script's steps in a `--dry-run` at tiny
sizes on this machine's CPU with the project's environment (which has torch).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The lent machine's image (the device tool's KINDS.md, "Python packages already there", read 2026-11-17):
# a requirement on one of these is met there and is not carried.
IMAGE_HAS = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-ml-py onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo
pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split())

# What the device runs: behemoth's requirements with the Ray extras its code imports (the dashboard's extra,
# `default`, is left out: the tier's local instance needs no dashboard).
ROOTS = ["ray[train,tune,data]==2.60.0", "simplejpeg>=1.7", "datasets>=3.0"]

# Never carried even if a requirement names them: the tier starts no dashboard, reads no cloud storage and
# runs no Ray Serve (their absence is checked by the rehearsal's Ray start).
NOT_NEEDED = frozenset({"opencensus", "opentelemetry-sdk", "opentelemetry-api", "opentelemetry-exporter-prometheus",
                        "opentelemetry-proto", "smart-open", "virtualenv", "py-spy", "colorful", "aiohttp-cors",
                        "tensorboardx", "grpcio-tools"})

# Parts of Ray's wheel that behemoth never imports (~31 MB of its ~76 MB compressed)
RAY_TRIM = ("ray/jars/", "ray/rllib/", "ray/serve/", "ray/llm/", "ray/dashboard/client/build/")
CARRY_LIMIT = 64 * 2**20
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64",
             "manylinux1_x86_64"]
TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements_of(wheel: Path, extras: set[str]) -> list[str]:
    """The Requires-Dist of a wheel that apply on the lent machine with `extras` asked for."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    wanted = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is None or any(req.marker.evaluate({**TARGET_ENV, "extra": e}) for e in extras | {""}):
            wanted.append(str(req).split(";")[0].strip())
    return wanted


def download(requirement: str, into: Path) -> Path:
    """One wheel for CPython 3.12 manylinux x86_64, with no dependencies (they are walked here)."""
    before = set(into.glob("*.whl"))
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                           "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(into),
                           requirement], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"gpu kit: pip could not download {requirement!r} for Python 3.12 manylinux x86_64:\n"
                         f"{done.stderr.strip()[-1500:]}")
    new = set(into.glob("*.whl")) - before
    name = canonical(re.split(r"[\[<>=!~ ]", requirement, maxsplit=1)[0])
    return next(iter(new)) if new else next(w for w in into.glob("*.whl") if canonical(w.name.split("-")[0]) == name)


def closure(into: Path) -> dict[str, dict]:
    """Download every distribution the roots need that the image lacks; returns name -> {wheel, why}."""
    from packaging.requirements import Requirement

    got: dict[str, dict] = {}
    todo = [(root, "behemoth") for root in ROOTS]
    while todo:
        spec, why = todo.pop(0)
        req = Requirement(spec)
        name = canonical(req.name)
        if name in IMAGE_HAS or name in NOT_NEEDED or name in got:
            continue
        wheel = download(spec, into)
        got[name] = {"wheel": wheel.name, "why": why}
        todo += [(r, name) for r in requirements_of(wheel, set(req.extras))]
    return got


def trim_wheel(wheel: Path, drop: tuple[str, ...]) -> tuple[int, int]:
    """Rewrite `wheel` without the files under `drop`, its RECORD listing exactly what remains (pip checks it).
    Returns (bytes before, bytes after)."""
    before = wheel.stat().st_size
    tmp = wheel.with_suffix(".trimmed")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        rows = []
        for info in src.infolist():
            if info.filename == record_name or info.filename.startswith(drop):
                continue
            data = src.read(info)
            out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f"{info.filename},sha256={digest},{len(data)}")
        rows.append(f"{record_name},,")
        out.writestr(record_name, "\n".join(rows) + "\n")
    tmp.replace(wheel)
    return before, wheel.stat().st_size


def tree_bytes() -> int:
    """What travels with a device call besides the kit: tracked and untracked-not-ignored files."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum((REPO / p.decode()).stat().st_size for p in listed if p and (REPO / p.decode()).is_file())


def build(out: Path) -> int:
    wheels = out / "wheels"
    shutil.rmtree(out, ignore_errors=True)
    wheels.mkdir(parents=True)
    got = closure(wheels)
    ray = wheels / got["ray"]["wheel"]
    before, after = trim_wheel(ray, RAY_TRIM)
    kit = sum(w.stat().st_size for w in wheels.glob("*.whl"))
    tree = tree_bytes()
    (out / "kit.json").write_text(json.dumps({
        "python": "cp312 manylinux x86_64", "image_has": "tests/gpu_kit.py IMAGE_HAS", "roots": ROOTS,
        "wheels": {n: {**v, "bytes": (wheels / v["wheel"]).stat().st_size} for n, v in sorted(got.items())},
        "ray_trimmed": {"dropped": RAY_TRIM, "bytes_before": before, "bytes_after": after},
        "kit_bytes": kit, "tree_bytes": tree}, indent=1))
    for name, v in sorted(got.items()):
        print(f"  {v['wheel']:<70} {(wheels / v['wheel']).stat().st_size / 2**20:6.1f} MiB  (for {v['why']})")
    print(f"gpu kit: {len(got)} wheels, {kit / 2**20:.1f} MiB (Ray's wheel {before / 2**20:.1f} -> "
          f"{after / 2**20:.1f} MiB); with the working tree ({tree / 2**20:.1f} MiB) {(kit + tree) / 2**20:.1f} MiB "
          f"of the {CARRY_LIMIT // 2**20} MiB a device call carries: {out}")
    if kit + tree > CARRY_LIMIT:
        print(f"gpu kit: over the carry limit by {(kit + tree - CARRY_LIMIT) / 2**20:.1f} MiB", file=sys.stderr)
        return 1
    return 0


# What the rehearsal's Python 3.12 gets from the package index, standing in for the image: the image's packages
# that Ray's core, Ray Data/Tune/Train's imports and behemoth's data side load (not torch: see the docstring).
REHEARSAL_IMAGE = ["numpy", "pyarrow", "pandas", "pyyaml", "packaging", "click", "filelock", "msgpack", "protobuf",
                   "requests", "aiohttp", "fsspec", "attrs", "psutil", "pillow", "tqdm", "huggingface-hub", "xxhash",
                   "grpcio", "typing-extensions", "prometheus-client", "pytest", "cloudpickle"]


def python312() -> str:
    """BEHEMOTH_PY312, else pyenv's newest 3.12, else python3.12 on PATH (pyenv's shim fails where 3.12 is not
    pyenv's chosen version: each candidate must run)."""
    pyenv = sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))
    for found in [os.environ.get("BEHEMOTH_PY312"), *map(str, reversed(pyenv)), shutil.which("python3.12")]:
        if found and subprocess.run([found, "-c", "import venv"], capture_output=True).returncode == 0:
            return found
    raise SystemExit("gpu kit rehearsal: no Python 3.12 here (pyenv's, python3.12 on PATH, or BEHEMOTH_PY312)")


_SMOKE = """
import ray, ray.data, ray.train, ray.tune  # noqa: F401  (ray.train.torch needs torch: absent here)
import simplejpeg, pydantic, jsonschema, datasets  # noqa: F401
ray.init(num_cpus=2, include_dashboard=False, logging_level="error")
total = ray.data.range(1000).map_batches(lambda b: {"id": b["id"] * 2}).sum("id")
assert total == 999 * 1000, total
print("rehearsal: Ray", ray.__version__, "started; a Ray Data pipeline summed", total)
ray.shutdown()
"""


def rehearse(kit: Path, dry_run: bool) -> int:
    if not (kit / "wheels").is_dir():
        raise SystemExit(f"gpu kit rehearsal: no kit at {kit}: build it first (./run.sh gpu-kit)")
    work = Path(tempfile.mkdtemp(prefix="bh-kit-"))
    try:
        venv = work / "py312"
        subprocess.run([python312(), "-m", "venv", str(venv)], check=True)
        py = str(venv / "bin" / "python")
        # (--no-compile: the image's packages come byte-compiled; compiling them here cost ~10 CPU-s)
        subprocess.run([py, "-m", "pip", "install", "-q", "--no-compile", *REHEARSAL_IMAGE], check=True)
        site = work / "site"
        # exactly the lent machine's install (tests/gpu_kit.sh)
        subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site),
                        *map(str, sorted((kit / "wheels").glob("*.whl")))], check=True)
        env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO / 'platform'}", "TMPDIR": str(work)}
        env.pop("RAY_ADDRESS", None)
        subprocess.run([py, "-c", _SMOKE], check=True, env=env, cwd=work, timeout=300)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not dry_run:
        return 0
    # the device script's steps at tiny sizes, on this CPU, in the project's environment
    return subprocess.run(["bash", str(REPO / "tests" / "gpu_kit.sh"), "--dry-run"], cwd=REPO).returncode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["build", "rehearse"])
    p.add_argument("--out", "--kit", dest="kit", type=Path, default=REPO / "gpu-kit")
    p.add_argument("--no-dry-run", action="store_true", help="rehearse: the install and Ray start only")
    a = p.parse_args()
    return build(a.kit) if a.what == "build" else rehearse(a.kit, not a.no_dry_run)


if __name__ == "__main__":
    sys.exit(main())
