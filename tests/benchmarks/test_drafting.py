"""The drafting benchmark on a tiny model: drafts off and on collect the same episodes."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import drafting  # noqa: E402


def test_drafts_off_and_on_alternate_over_the_same_tasks(tiny_model_dir, monkeypatch, capsys):
    argv = ["drafting.py", "--model", tiny_model_dir, "--env", "Calculator-v0"]
    argv += ["--env-kwargs", '{"source": "basic_arithmetic"}', "--tasks", "1"]
    argv += ["--group-size", "2", "--max-new-tokens", "6", "--rounds", "1", "--dtype", "float32"]
    monkeypatch.setattr(sys, "argv", argv)
    drafting.main()
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.split()[:1] in (["0"], ["4"])]
    assert [(r[0], r[1]) for r in rows] == [("0", "0"), ("4", "0"), ("0", "10"), ("4", "10")]
    assert rows[0][5] == rows[1][5] and rows[2][5] == rows[3][5]  # float32: the same tokens
    assert all(r[7] == "1.00" for r in rows[::2])  # without drafts, a token a step
    summary = next(line for line in lines if line.startswith("decoding:"))
    assert "token counts differ" not in summary
