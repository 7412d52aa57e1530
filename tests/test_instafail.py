"""TKJIT_INSTAFAIL=1 (set by benchmarks/h200/scripts): a failure's message reaches stderr when it happens, so a
run killed at its time limit keeps it (the summary at the end never prints then)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path


def test_failure_message_is_written_when_it_happens(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_x.py").write_text('def test_boom():\n    assert 1 == 2, "the message"\n')
    env = {**os.environ, "TKJIT_INSTAFAIL": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert r.returncode == 1
    assert "!!! FAILED test_x.py::test_boom (call)" in r.stderr and "the message" in r.stderr
    env.pop("TKJIT_INSTAFAIL")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert r.returncode == 1 and "!!!" not in r.stderr
