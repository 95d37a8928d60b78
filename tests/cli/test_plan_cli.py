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


def test_plan_for_a_loop_that_accumulates_and_clips_says_the_optimizer_clips_itself(capsys):
    code = main(["profile", "--model", "small-gpt", "--layers", "2", "--batch", "1", "--seq", "16", "--dtype",
                 "fp32", "--device", "cpu", "--techniques", "in_backward_each", "--accumulation-steps", "2",
                 "--clip-grad-norm", "1.0", "--plot", ""])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("in_backward_each: predicted peak")
    assert main(["profile", "--model", "small-gpt", "--layers", "2", "--batch", "1", "--seq", "16", "--dtype",
                 "fp32", "--device", "cpu", "--techniques", "in_backward_each", "--plot", ""]) == 0
    assert capsys.readouterr().out != out  # (the two passes and the micro-batches' gradients weigh)


def test_plan_with_a_budget_nothing_meets_exits_1_names_the_closest_and_plots_how_far(tmp_path, capsys):
    # SGD: no low-bit AdamW state to trace once nothing else fits (the same exit, without 27 more traces); the plot
    # (no extension: the PNG matplotlib writes, named as written) was not written where none fits, as --help says
    plot = tmp_path / "plans"
    code = main(["plan", "--model", "small-gpt", "--layers", "2", "--batch", "1", "--seq", "16", "--dtype", "fp32",
                 "--device", "cpu", "--optimizer", "sgd", "--budget", "10KB", "--plot", str(plot)])
    captured = capsys.readouterr()
    assert code == 1
    assert "no plan fits" in captured.err and "closest" in captured.err
    assert f"plot: {plot}.png" in captured.out and (tmp_path / "plans.png").read_bytes()[:4] == b"\x89PNG"


def test_profile_prints_the_peak_by_category(tmp_path, capsys):
    plot = tmp_path / "timeline.png"
    code = main(["profile", "--model", "small-gpt", "--layers", "2", "--batch", "1", "--seq", "16", "--dtype",
                 "fp32", "--device", "cpu", "--techniques", "checkpoint", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("checkpoint: predicted peak") and "optimizer_state" in out
    assert plot.exists()


@pytest.mark.parametrize("argv, message", [
    (["--budget", "lots"], "error: memtrim plan: cannot read the size"),  # (once "memtrim plan: memtrim.plan: ...")
    (["--budget", "-1"], "a budget must be a finite size of at least 1 byte, got '-1'"),
    (["--budget", "1GiB", "--batch", "0"], "--batch must be >= 1"),
    # checked before tracing: a folder that cannot be written, a format matplotlib cannot write (a traceback after
    # all the planning; found by an adversarial pass on 2026-12-02)
    (["--budget", "1GiB", "--plot", "/proc/plan.png"], "the folder '/proc' cannot be written"),
    (["--budget", "1GiB", "--plot", "plan.xyz"], "matplotlib cannot write .xyz"),
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


@pytest.mark.parametrize("argv, message", [
    (["--layers", "0"], "--layers must be >= 1, got 0"),  # was silently the default depth
    (["--device", "tpu"], "cannot read --device 'tpu'"),
    (["--plot", "no/such/folder/plan.png"], "no folder"),
])
def test_more_usage_errors_exit_2_with_one_line(argv, message, capsys):
    code = main(["plan", "--model", "small-gpt", "--layers", "2", "--seq", "16", "--device", "cpu", "--plot", "",
                 "--budget", "1GiB", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and err.count("\n") == 1


def _user_module(tmp_path, monkeypatch, name, source):
    """A module of the user's, ``name``.py holding ``source``, importable from the working directory."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_user_factory_that_raises_or_is_not_callable_exits_2_naming_this_command(tmp_path, monkeypatch, capsys):
    _user_module(tmp_path, monkeypatch, "usermodels", "def broken():\n    raise RuntimeError('my factory is broken')\n"
                                                      "CONST = 5\n")
    for spec, message in (("usermodels:broken", "RuntimeError: my factory is broken"),
                          ("usermodels:CONST", "memtrim plan: --model 'usermodels:CONST' is a int, not callable")):
        code = main(["plan", "--model", spec, "--seq", "16", "--device", "cpu", "--budget", "1GiB", "--plot", ""])
        err = capsys.readouterr().err
        assert code == 2 and message in err and "check-inplace" not in err
        assert err.strip().splitlines()[-1].startswith("error: memtrim plan:")


def test_layers_reaches_a_user_factory_of_the_block_count_or_exits_2(tmp_path, monkeypatch, capsys):
    # --layers was ignored for a user's factory: the same plan with and without it (an adversarial pass on 2026-12-02)
    _user_module(tmp_path, monkeypatch, "lms",
                 "import torch\n\ndef deep(layers=1):\n    return torch.nn.Sequential(torch.nn.Embedding(256, 8), "
                 "*[torch.nn.Linear(8, 8) for _ in range(layers)], torch.nn.Linear(8, 256))\n\n"
                 "def fixed():\n    return deep(1)\n")
    plain = {}
    for layers in (None, "1", "4"):
        argv = ["plan", "--model", "lms:deep", "--seq", "8", "--device", "cpu", "--budget", "1GiB", "--plot", "",
                *(["--layers", layers] if layers else [])]
        assert main(argv) == 0
        plain[layers] = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| plain"))
    assert plain[None] == plain["1"] != plain["4"]
    code = main(["plan", "--model", "lms:fixed", "--layers", "4", "--seq", "8", "--device", "cpu", "--budget", "1GiB",
                 "--plot", ""])
    err = capsys.readouterr().err
    assert code == 2 and "--layers 4 needs a model factory taking the number of blocks" in err


def test_a_model_given_where_a_factory_is_expected_exits_2_saying_so(tmp_path, monkeypatch, capsys):
    # it was called as a forward with no input: "the model factory raised under FakeTensorMode (ValueError: ...)"
    _user_module(tmp_path, monkeypatch, "built",
                 "import torch\n\nMODEL = torch.nn.Sequential(torch.nn.Embedding(256, 8))\n")
    code = main(["plan", "--model", "built:MODEL", "--seq", "8", "--device", "cpu", "--budget", "1GiB", "--plot", ""])
    err = capsys.readouterr().err
    assert code == 2 and "--model 'built:MODEL' is a model (Sequential), not a function returning one" in err


def test_a_model_the_tokens_do_not_fit_exits_2_without_torchs_logged_traceback(tmp_path, monkeypatch, capfd):
    # torch logs a failing fake kernel with its traceback: 19 lines of it came before memtrim's one-line error
    _user_module(tmp_path, monkeypatch, "notlm", "import torch\n\ndef linear():\n    return torch.nn.Linear(4, 4)\n")
    code = main(["plan", "--model", "notlm:linear", "--seq", "16", "--device", "cpu", "--budget", "1GiB",
                 "--plot", ""])
    err = capfd.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: memtrim plan: the plain training step failed")


@pytest.mark.parametrize("techniques, message", [
    ("selective,checkpoint", "do not combine"),
    ("state_8bit,state_4bit", "do not combine"),
    ("offload_state", "offload_state was not traced: offload_state: left out; on cpu"),  # was a StopIteration
])
def test_profile_of_a_combination_that_cannot_be_traced_exits_2(techniques, message, capsys):
    code = main(["profile", "--model", "small-gpt", "--layers", "2", "--seq", "16", "--device", "cpu", "--techniques",
                 techniques, "--plot", ""])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err.splitlines()[-1]


def test_profile_of_low_bit_state_and_at_an_extrapolated_depth_writes_the_timeline(tmp_path, capsys):
    plot = tmp_path / "timeline.png"  # --layers 3: the peak is extrapolated; the timeline was silently not written
    code = main(["profile", "--model", "small-gpt", "--layers", "3", "--seq", "16", "--dtype", "fp32", "--device",
                 "cpu", "--techniques", "state_8bit", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("state_8bit: predicted peak") and f"timeline: {plot}" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
