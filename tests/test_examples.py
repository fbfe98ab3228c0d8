"""Every script in examples/ runs with ``--smoke`` (a tiny model, a couple of steps)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


@pytest.mark.integration
@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_smoke(script, tmp_path):
    # NOTE: earlier in-process distributed runs (DDP, DeepSpeed configs) leave MASTER_PORT & co. in os.environ, and
    # DeepSpeed keeps that port's store bound; a child inheriting them would fail with EADDRINUSE.
    dist_vars = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE"}
    env = {k: v for k, v in os.environ.items() if k not in dist_vars} | {"PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(script), "--smoke"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
