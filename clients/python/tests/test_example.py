"""The README's example runs as documented and leaves one row."""

import os
import pathlib
import subprocess
import sys

from harness import BrokerProcess

HERE = pathlib.Path(__file__).resolve().parents[1]


def test_the_check_then_insert_example_leaves_one_row(broker: BrokerProcess) -> None:
    env = dict(os.environ, PYTHONPATH=str(HERE / "src"))
    done = subprocess.run(
        [sys.executable, str(HERE / "examples" / "check_then_insert.py"), broker.url],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "rows: 1\n" in done.stdout
    assert "'inserted': 1" in done.stdout
