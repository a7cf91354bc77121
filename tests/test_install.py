"""`pip install CHECKOUT` (what `make venv` runs) claims no importable name: the project's programs run from the
checkout, and the install brings the pinned requirements and the `moevement-lm-eval` command, which runs the
checkout it was installed from. Offline: a fresh virtual environment sees the shared .venv's packages after
its own, and pip builds without isolation, installs no dependency and looks nothing up."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from eval.lm_eval_tasks.local_data import HELLASWAG_FILE_ENV
from tests.helpers import CHILD_ENV, ROOT

NOT_SOURCE = ("__pycache__", ".git", ".venv", ".pytest_cache", ".ruff_cache", "outputs", "build", "*.egg-info")


def _fresh_venv(path: Path) -> Path:
    """A new virtual environment at `path` whose own site-packages comes first and the shared .venv's after it;
    its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(path), "platbase": str(path)}))
    (site / "shared_venv.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return site


def test_an_install_claims_no_name_and_its_command_runs_the_checkout(tmp_path):
    checkout = tmp_path / "checkout"
    shutil.copytree(ROOT, checkout, symlinks=True, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    venv = tmp_path / "venv"
    site = _fresh_venv(venv)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index"]
    build = subprocess.run(
        [*pip, "--ignore-installed", "--disable-pip-version-check", str(checkout)],
        env=CHILD_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = build.stdout + build.stderr
    assert build.returncode == 0 and "warning" not in output.lower(), output
    assert sorted(p.name for p in site.iterdir()) == ["moevement-0.1.0.dist-info", "shared_venv.pth"]
    assert (site / "moevement-0.1.0.dist-info" / "top_level.txt").read_text().strip() == ""

    user = tmp_path / "user"
    (user / "models").mkdir(parents=True)
    (user / "models" / "__init__.py").write_text("WHOSE = 'the user'\n")
    program = "import models\nprint(models.WHOSE)\nimport trainer\n"
    env = {k: v for k, v in CHILD_ENV.items() if k not in ("PYTHONPATH", HELLASWAG_FILE_ENV)}
    ran = subprocess.run(
        [str(venv / "bin" / "python"), "-c", program], cwd=user, env=env, capture_output=True, text=True, timeout=60
    )
    assert ran.stdout == "the user\n" and "No module named 'trainer'" in ran.stderr, ran.stdout + ran.stderr

    command = subprocess.run(
        [str(venv / "bin" / "moevement-lm-eval"), "--tasks", "hellaswag_local"],
        cwd=user,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    task_file = checkout / "eval" / "lm_eval_tasks" / "hellaswag_local.yaml"
    assert command.returncode == 2, command.stdout + command.stderr
    assert command.stderr.startswith(f"error: hellaswag_local ({task_file}): no HellaSwag file"), command.stderr
    assert command.stderr.count("\n") == 1 and os.access(venv / "bin" / "moevement-lm-eval", os.X_OK)
