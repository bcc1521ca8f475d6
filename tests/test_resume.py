"""Robust training: kill -9 then --resume ends where an uninterrupted run ends; other runs' checkpoints are
refused; a full disk while saving keeps the last good checkpoint."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_distill import quick_config, tiny_converted, token_data

import dofla.distill.checkpoint as checkpoint
from dofla.distill.trainer import distill
from dofla.errors import DoflaError
from dofla.models.surgery import students

TESTS = Path(__file__).parent
STEPS = 12

SCRIPT = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    import torch
    from safetensors.torch import save_file
    from test_distill import quick_config, tiny_converted, token_data
    from dofla.convert import students
    from dofla.distill.trainer import distill

    torch.set_num_threads(1)
    run_dir, resume, delay = sys.argv[1], sys.argv[2] == "resume", float(sys.argv[3])
    model = tiny_converted()
    config = quick_config(tokens={tokens}, checkpoint_every=2)
    distill(model, token_data(), token_data(8, seed=1), config, run_dir, resume=resume,
            on_step=lambda step, record: time.sleep(delay))
    weights = {{f"{{i}}.{{n}}": p for i, s in students(model).items() for n, p in s.named_parameters()}}
    save_file({{n: p.detach().contiguous() for n, p in weights.items()}}, run_dir + "/final.safetensors")
    """
)


def final_weights(model) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{n}": p.detach().clone() for i, s in students(model).items() for n, p in s.named_parameters()
    }


def uninterrupted(**changes) -> dict[str, torch.Tensor]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_converted()
        distill(model, token_data(), token_data(8, seed=1), quick_config(tokens=4 * 24 * STEPS, **changes))
    finally:
        torch.set_num_threads(threads)
    return final_weights(model)


def test_kill_9_then_resume_equals_uninterrupted_run(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=str(TESTS), tokens=4 * 24 * STEPS))
    run_dir = tmp_path / "run"
    # the subprocess trains with the dofla under test (a worktree's src), not whichever one is installed
    source = Path(checkpoint.__file__).resolve().parents[2]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(source)])}
    process = subprocess.Popen([sys.executable, str(script), str(run_dir), "fresh", "1.0"], env=environment)
    latest = run_dir / "checkpoints" / checkpoint.LATEST_FILE
    deadline = time.monotonic() + 120
    while not latest.exists() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
    assert latest.exists(), "the training subprocess wrote no checkpoint in time"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    killed_at = json.loads(latest.read_text())["step"]
    assert 0 < killed_at < STEPS and not (run_dir / "final.safetensors").exists()

    resumed = subprocess.run(
        [sys.executable, str(script), str(run_dir), "resume", "0"], env=environment, timeout=300
    )
    assert resumed.returncode == 0
    weights = load_file(str(run_dir / "final.safetensors"))
    expected = uninterrupted(checkpoint_every=2)
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-6)
    log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    assert [record["step"] for record in log if "loss" in record] == list(range(1, STEPS + 1))


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path):
    distill(tiny_converted(), token_data(), token_data(8, seed=1), quick_config(), tmp_path)
    with pytest.raises(DoflaError, match="belongs to a different run"):
        distill(
            tiny_converted(), token_data(), token_data(8, seed=1), quick_config(seed=5), tmp_path, resume=True
        )
    other_plan = tiny_converted(kind="hybrid", feature_map="hedgehog")
    with pytest.raises(DoflaError, match="belongs to a different run"):
        distill(other_plan, token_data(), token_data(8, seed=1), quick_config(), tmp_path, resume=True)


def test_full_disk_while_saving_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    saves = {"count": 0}
    real_save = torch.save

    def save_until_disk_is_full(*args, **kwargs):
        saves["count"] += 1
        if saves["count"] > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", save_until_disk_is_full)
    with pytest.raises(
        DoflaError, match=r"could not write the checkpoint of step 8 .*previous checkpoint was kept"
    ):
        distill(tiny_converted(), token_data(), token_data(8, seed=1), quick_config(), tmp_path)
    folder = tmp_path / "checkpoints"
    assert json.loads((folder / checkpoint.LATEST_FILE).read_text())["step"] == 4
    assert sorted(path.name for path in folder.iterdir()) == ["latest.json", "step-00000004"]
    monkeypatch.setattr(torch, "save", real_save)
    model = tiny_converted()
    distill(model, token_data(), token_data(8, seed=1), quick_config(), tmp_path, resume=True)
    expected_model = tiny_converted()
    distill(expected_model, token_data(), token_data(8, seed=1), quick_config())
    for name, tensor in final_weights(expected_model).items():
        torch.testing.assert_close(final_weights(model)[name], tensor, rtol=0, atol=1e-6)


def test_nan_students_are_never_checkpointed(tmp_path):
    tensors = {"param/x": torch.ones(2)}
    checkpoint.save_checkpoint(tmp_path, 3, tensors, {"state": {}, "param_groups": []}, {"step": 3})
    loaded, _, state = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(tmp_path))
    assert state["step"] == 3 and torch.equal(loaded["param/x"], torch.ones(2))
    # the trainer refuses to save non-finite students (warns, keeps the last checkpoint)
    model = tiny_converted()
    for parameter in students(model)[0].parameters():
        parameter.data.fill_(float("nan"))
    with (
        pytest.raises(DoflaError, match="non-finite loss.*no checkpoint was written"),
        pytest.warns(UserWarning),
    ):
        distill(
            model,
            token_data(),
            token_data(8, seed=1),
            quick_config(max_bad_steps=3, checkpoint_every=1),
            tmp_path / "nan",
        )
    assert not (tmp_path / "nan" / "checkpoints").exists()


def test_damaged_pointer_is_a_clear_error(tmp_path):
    (tmp_path / checkpoint.LATEST_FILE).write_text("{not json")
    with pytest.raises(DoflaError, match="is damaged"):
        checkpoint.latest_checkpoint(tmp_path)
