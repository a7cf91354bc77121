"""`metrics.profile`: the trainer writes Algorithm 1's inputs as it planned a window, and the simulator's
`--window-profile` computes the same W from them (trainer/records/window_profile.py, simulator/profile.py)."""

import json

import pytest

from moevement.checkpoint.planner import WindowInputs
from moevement.checkpoint.schedule import find_window_size
from simulator.profile import WindowProfile
from tests.helpers import BASE, MOEVEMENT, run_cli
from trainer.records.window_profile import profile_record, write_window_profile


@pytest.mark.parametrize("bandwidth", [2e8, 2e9, 2e10])
def test_the_simulator_reads_the_trainers_profile_and_finds_its_window(tmp_path, bandwidth):
    """The written JSON loads as a `WindowProfile` whose W is the trainer's `find_window_size` on the same
    inputs, at three bandwidths."""
    fp32, compute = [4_000_000] * 12 + [40_000_000] * 4, [1_000_000] * 12 + [10_000_000] * 4
    window = find_window_size(fp32, compute, 0.05, bandwidth)[0]
    inputs = WindowInputs(0.05, tuple(fp32), tuple(compute), bandwidth, window)
    line = write_window_profile(str(tmp_path / "p.json"), inputs, replicas=1)
    assert line.startswith(f"metrics.profile: wrote {tmp_path / 'p.json'} (T=0.050 s, W={window}, 16 operators)")
    profile = WindowProfile.from_json((tmp_path / "p.json").read_text())
    assert profile.window()[0] == window and profile_record(inputs, 1) == json.loads((tmp_path / "p.json").read_text())


def test_no_profile_through_a_symlink_nor_without_a_planned_window(tmp_path):
    (tmp_path / "elsewhere").write_text("mine")
    (tmp_path / "link.json").symlink_to(tmp_path / "elsewhere")
    inputs = WindowInputs(0.05, (1,), (1,), 1e9, 1)
    assert "symlink" in write_window_profile(str(tmp_path / "link.json"), inputs, 1)
    assert (tmp_path / "elsewhere").read_text() == "mine"
    assert "no window was planned" in write_window_profile(str(tmp_path / "p.json"), None, 1)


@pytest.mark.slow
def test_a_training_runs_profile_gives_the_simulator_its_window(tmp_path):
    """A MoEvement run with `--metrics.profile` writes the file; `python -m simulator --window-profile` on
    it prints the W the run used."""
    path = tmp_path / "profile.json"
    args = [*BASE, "--training.steps", "6", *MOEVEMENT[:2], "--checkpoint.host_dir", str(tmp_path / "shm")]
    out = run_cli(*args, "--metrics.profile", str(path)).stdout
    window = int(out.split("metrics.profile: wrote ")[1].split("W=")[1].split(",")[0])
    assert json.loads(path.read_text())["window"] == window
    assert WindowProfile.from_json(path.read_text()).window()[0] == window
