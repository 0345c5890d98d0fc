"""Exact resume needs float results that do not depend on where the operands sit in memory."""

import json
import subprocess
import sys

from behemoth.driver.ray_cluster.session import worker_env_vars

# The same [64 x 48] @ [48 x 1] product (PowerSGD's P = M Q at rank 1) with M at each of 16 float offsets in a
# larger buffer, as PowerSGD's matrices are views into DDP's gradient buckets at layout-dependent offsets.
_PROBE = """
import json, torch
torch.manual_seed(0)
n, m = 64, 48
a, q = torch.randn(n, m), torch.randn(m, 1)
results = []
for offset in range(16):
    buf = torch.empty(n * m + 16)
    view = buf[offset:offset + n * m].view(n, m)
    view.copy_(a)
    results.append(torch.matmul(view, q))
print(json.dumps([o for o, r in enumerate(results) if not torch.equal(r, results[0])]))
"""


def offsets_that_differ(env: dict) -> list[int]:
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_worker_environment_makes_matmul_independent_of_alignment(monkeypatch):
    """Fails where the BLAS picks code paths by alignment (MKL on AMD EPYC, AVX2: 12 of 16 offsets differed
    without MKL_CBWR) unless behemoth's worker environment is in force; passes anywhere with it."""
    import os

    monkeypatch.delenv("MKL_CBWR", raising=False)
    assert worker_env_vars()["MKL_CBWR"] == "AUTO,STRICT"
    assert offsets_that_differ({**os.environ, **worker_env_vars()}) == []


def test_a_users_own_mkl_setting_wins(monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    assert worker_env_vars()["MKL_CBWR"] == "COMPATIBLE"
    monkeypatch.setenv("RAY_TRAIN_ENABLE_PRINT_PATCH", "1")  # the same for Ray Train's print patch (off by default)
    assert worker_env_vars() == {"MKL_CBWR": "COMPATIBLE", "RAY_TRAIN_ENABLE_PRINT_PATCH": "1"}
