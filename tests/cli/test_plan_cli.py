"""memtrim plan / memtrim profile: a table and a plot for a plan that fits (exit 0), the closest plan when none
fits (exit 1), one line and exit 2 for a usage error."""

import pytest

from memtrim.cli import main


def test_plan_small_gpt_prints_the_plans_and_writes_the_plot(tmp_path, capsys):
    plot = tmp_path / "plan.png"
    code = main(["plan", "--model", "small-gpt", "--layers", "2", "--batch", "2", "--seq", "32", "--dtype", "fp32",
                 "--device", "cpu", "--budget", "1GiB", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert code == 0
    assert "| plain |" in out and "| checkpoint+in_backward_each |" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_with_a_budget_nothing_meets_exits_1_and_names_the_closest(capsys):
    code = main(["plan", "--model", "small-gpt", "--layers", "2", "--batch", "1", "--seq", "16", "--dtype", "fp32",
                 "--device", "cpu", "--budget", "10KB", "--plot", ""])
    captured = capsys.readouterr()
    assert code == 1
    assert "no plan fits" in captured.err and "closest" in captured.err


def test_profile_prints_the_peak_by_category(tmp_path, capsys):
    plot = tmp_path / "timeline.png"
    code = main(["profile", "--model", "small-gpt", "--layers", "2", "--batch", "1", "--seq", "16", "--dtype",
                 "fp32", "--device", "cpu", "--techniques", "checkpoint", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("checkpoint: predicted peak") and "optimizer_state" in out
    assert plot.exists()


@pytest.mark.parametrize("argv, message", [
    (["--budget", "lots"], "cannot read the size"),
    (["--budget", "1GiB", "--batch", "0"], "--batch must be >= 1"),
])
def test_usage_errors_exit_2_with_one_line(argv, message, capsys):
    code = main(["plan", "--model", "small-gpt", "--layers", "2", "--seq", "16", "--device", "cpu", "--plot", "",
                 *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and err.count("\n") == 1


def test_a_model_spec_that_does_not_resolve_exits_2(capsys):
    code = main(["plan", "--model", "no_such_module:factory", "--budget", "1GiB", "--device", "cpu"])
    assert code == 2
    assert "does not resolve" in capsys.readouterr().err
