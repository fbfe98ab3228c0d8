"""The package as a user installs it: a wheel built from this tree, installed into a new virtual environment, runs
``lowmem --help`` and a two-step ``lowmem fit`` from its console script (metadata, entry point and package data).

No network: the wheel is built without build isolation (setuptools and wheel of the running environment) and
installed with ``--no-index --no-deps``. The new environment is made without system site-packages and has nothing
of this tree on its path; it inherits exactly one thing: the site-packages directories of the interpreter running
the test (``site.getsitepackages()``: where torch, Lightning, transformers, jsonargparse, psutil and matplotlib are
installed; a venv made with ``--system-site-packages`` lists the base interpreter's too), appended to its path by
one ``.pth`` file, AFTER its own site-packages. The ``.pth`` files of those directories are not processed (a path listed in a
``.pth`` file is not a site directory), so an editable install of this package there is not active: the test
checks that ``lightning_lowmem`` is imported from the new environment.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

TINY_RUN = {
    "seed_everything": 0,
    "trainer": {"accelerator": "cpu", "devices": 1, "strategy": "lowmem_offload", "precision": "bf16-true",
                "max_steps": 2, "logger": False, "enable_progress_bar": False, "enable_model_summary": False,
                "limit_val_batches": 0, "default_root_dir": "run",
                "callbacks": [{"class_path": "ActivationCheckpointing", "init_args": {"policy": "all"}}]},
    "model": {"class_path": "lightning_lowmem.demo.module.CausalLMModule",
              "init_args": {"config": {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 32}}},
    "data": {"class_path": "lightning_lowmem.demo.data.StdlibTextDataModule",
             "init_args": {"seq_len": 32, "batch_size": 2, "max_bytes": 20_000}},
}

CHECK = """
import importlib.metadata as md, json, sys
from pathlib import Path
import lightning_lowmem
from packaging.requirements import Requirement
from packaging.version import Version
dist = md.distribution("lightning-lowmem")
missing = []
for text in dist.requires or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra's requirement
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        missing.append(text)
        continue
    if not req.specifier.contains(Version(version), prereleases=True):
        missing.append(f"{text} (installed {version})")
package = Path(lightning_lowmem.__file__).parent
print(json.dumps({
    "file": lightning_lowmem.__file__,
    "version": dist.version,
    "scripts": sorted(f"{e.name}={e.value}" for e in dist.entry_points if e.group == "console_scripts"),
    "extras": sorted(dist.metadata.get_all("Provides-Extra") or []),
    "py_typed": (package / "py.typed").is_file(),
    "shapes": sorted(p.name for p in (package / "memory" / "shapes").glob("*.json")),
    "unsatisfied": missing,
}))
"""


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.slow
def test_wheel_installs_into_a_new_environment_and_lowmem_fit_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH", "PYTHONHOME")}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    # 1. a wheel of this tree (a copy: the build writes build/ and *.egg-info next to the sources)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "lightning_lowmem", src / "lightning_lowmem", ignore=shutil.ignore_patterns("__pycache__"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
          str(tmp_path / "dist"), str(src)], env, tmp_path)
    [wheel] = (tmp_path / "dist").glob("lightning_lowmem-*.whl")
    # 2. a new environment: no system site-packages; the running one's site-packages appended (see the docstring)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env, tmp_path)
    python = venv / "bin" / "python"
    own = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env, tmp_path)
    deps = [p for p in site.getsitepackages() if p != own.stdout.strip()]  # in the running interpreter's order
    (Path(own.stdout.strip()) / "_dependencies.pth").write_text("\n".join(deps) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
         env, tmp_path)
    # 3. what the wheel installed: the package, its data, its metadata and its console script
    info = json.loads(_run([str(python), "-c", CHECK], env, tmp_path).stdout.strip().splitlines()[-1])
    assert info["file"].startswith(str(venv)), info["file"]  # the wheel's copy, not this tree nor an editable one
    assert info["scripts"] == ["lowmem=lightning_lowmem.cli:main"]
    assert info["py_typed"] and "gpt2-xl.json" in info["shapes"] and "llama-7b.json" in info["shapes"]
    assert {"all", "bnb", "deepspeed"} <= set(info["extras"])
    assert info["unsatisfied"] == []  # every dependency the metadata names is met by the installed versions
    # 4. the console script: the help, then a two-step fit of a YAML in a project folder
    lowmem = venv / "bin" / "lowmem"
    assert "usage: lowmem {fit," in _run([str(lowmem), "--help"], env, tmp_path).stdout
    project = tmp_path / "project"
    project.mkdir()
    (project / "run.yaml").write_text(yaml.safe_dump(TINY_RUN))
    _run([str(lowmem), "fit", "--config", "run.yaml"], env, project, timeout=600)
    checkpoints = sorted(p.name for p in (project / "run").rglob("*.ckpt"))
    assert checkpoints == ["epoch=0-step=2.ckpt"], checkpoints
