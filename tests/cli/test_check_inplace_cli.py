"""`memtrim check-inplace`: names resolved like `python -m` does, usage errors exit 2 with one line (issue 10,
item 15)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from memtrim.cli import main

_MODULE = '''
import torch


def fn(x):
    return torch.relu(x)


def ref(x):
    return torch.relu(x)


def silu(x):
    return torch.nn.functional.silu(x)


class Holder:
    @staticmethod
    def fn(x):
        return torch.relu(x)
'''


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A user's directory holding ``mt_user_mod.py``, as the working directory, and not on ``sys.path``."""
    (tmp_path / "mt_user_mod.py").write_text(_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "mt_user_mod", raising=False)
    yield tmp_path
    sys.modules.pop("mt_user_mod", None)


def _console_script() -> str | None:
    candidate = Path(sys.executable).with_name("memtrim")
    return str(candidate) if candidate.exists() else shutil.which("memtrim")


def test_module_in_the_working_directory(workdir, capsys):
    assert main(["check-inplace", "mt_user_mod:fn", "--reference", "mt_user_mod:ref", "--shape", "4,5"]) == 0
    assert "ok" in capsys.readouterr().out


def test_dotted_attribute_and_module_path(workdir, capsys):
    assert main(["check-inplace", "mt_user_mod:Holder.fn", "--reference", "torch:relu", "--shape", "4,5"]) == 0


def test_console_script_finds_a_module_in_the_working_directory(tmp_path):
    script = _console_script()
    if script is None:
        pytest.skip("the memtrim console script is not installed")
    (tmp_path / "mt_user_mod.py").write_text(_MODULE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([script, "check-inplace", "mt_user_mod:fn", "--reference", "mt_user_mod:ref",
                           "--shape", "4,5"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "ok" in proc.stdout


def test_problem_found_exits_1(workdir, capsys):
    # the seed article's second in-place SiLU: right values, broken backward, and the checker says why
    code = main(["check-inplace", "memtrim.models.seed_silu:silu_inplace_2", "--reference", "mt_user_mod:silu",
                 "--shape", "4,5"])
    assert code == 1
    assert "sigmoid_ keeps its output for backward, and mul_ then overwrote it" in capsys.readouterr().out
    assert main(["check-inplace", "memtrim.models.seed_silu:silu_inplace_1", "--reference", "mt_user_mod:silu",
                 "--shape", "4,5"]) == 1
    assert "values differ" in capsys.readouterr().out
    assert main(["check-inplace", "memtrim.models.seed_silu:silu_inplace_2_corrected", "--reference",
                 "torch.nn.functional:silu", "--shape", "16,8"]) == 0


@pytest.mark.parametrize("argv, says", [
    (["--shape", "3,x"], "--shape"),
    (["--shape", "4,-5"], "--shape"),
    (["--shape", ""], "--shape"),
    (["--shape", "100000000000,100000000000"], "--shape"),
    (["--shape", "1000000000,1000000000"], "--shape"),
    (["--dtype", "float33"], "--dtype"),
    (["--dtype", "int64"], "--dtype"),
    (["--dtype", "Size"], "--dtype"),
    (["--draws", "0"], "--draws"),
], ids=["not-int", "negative", "empty", "overflow", "too-large", "unknown-dtype", "int-dtype", "not-a-dtype",
        "no-draws"])
def test_usage_errors_exit_2_with_one_line(argv, says, workdir, capsys):
    code = main(["check-inplace", "torch:relu", "--reference", "torch:relu", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert says in err
    assert "Traceback" not in err


@pytest.mark.parametrize("name", ["mt_no_such_module:fn", "mt_user_mod:nosuch", "mt_user_mod", "mt_user_mod:",
                                  ":fn", "torch.nn:Module.nosuch"])
def test_names_that_do_not_resolve_exit_2_with_one_line(name, workdir, capsys):
    code = main(["check-inplace", name, "--reference", "torch:relu", "--shape", "4,5"])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert name in err


def test_not_callable_exits_2(workdir, capsys):
    code = main(["check-inplace", "torch:float32", "--reference", "torch:relu", "--shape", "4,5"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "callable" in err
