"""scripts/gpu/lmcache_repro.py, the stock reproduction of the LMCache findings, without LMCache or
vLLM: what it refuses before starting anything, and a system that does not start (exit status 2,
its result written, nothing left running)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _script():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("lmcache_repro", REPO / "scripts" / "gpu" / "lmcache_repro.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 2048}))
    return model


@pytest.mark.parametrize("tokens", [5001, 4992 + 128, 129])
def test_a_prompt_length_off_the_chunk_is_refused(tmp_path, tokens):
    """A's reference (its own prefix hit, whole blocks) and B's load (whole 256-token chunks) would
    cover different tokens and compute different partitions: B's text could differ with every
    byte right, a false "wrong"."""
    with pytest.raises(SystemExit) as exc:
        _script().main(["--model", str(_model(tmp_path)), "--out", str(tmp_path / "o"), "--tokens", str(tokens)])
    assert exc.value.code == 2 and not (tmp_path / "o").exists()


def test_an_output_folder_in_use_is_refused(tmp_path):
    """Its logs would be another run's lines read as this run's evidence."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "replica-B.log").write_text("AssertionError\n")
    assert _script().main(["--model", str(_model(tmp_path)), "--out", str(out)]) == 2
    assert sorted(p.name for p in out.iterdir()) == ["replica-B.log"]


def test_a_server_that_does_not_start_exits_2_with_its_result_written(tmp_path, capsys):
    """The interpreter given cannot run LMCache's server (it exits at once): exit status 2, the
    reason in result.json, and the process stopped."""
    out = tmp_path / "o"
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.exit(3)\n")
    fake.chmod(0o755)
    assert _script().main(["--model", str(_model(tmp_path)), "--out", str(out), "--python", str(fake)]) == 2
    result = json.loads((out / "result.json").read_text())
    assert "lmcache server exited with status 3" in result["not_started"]
    assert "stale_chunks" not in result
    assert "exited with status 3" in capsys.readouterr().err


def test_log_lines_are_read_without_colour_codes(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("\x1b[32;20m[t] LMCache INFO:\x1b[0m Retrieved 4864 tokens\nother\n")
    assert _script().lines(log, "Retrieved") == ["[t] LMCache INFO: Retrieved 4864 tokens"]
    assert _script().lines(tmp_path / "missing.log", "x") == []
