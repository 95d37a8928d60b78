"""`memtrim demo --quick` end to end, and the console entry point."""

import json
import subprocess
import sys

import pytest

from memtrim.cli import main


def test_demo_quick_writes_report(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    relu = results["relu_op"]
    side = relu["shape"][0]
    assert relu["torch.relu"]["allocated_bytes"] == side * side * 4
    assert relu["torch.relu_"]["allocated_bytes"] == 0
    runs = results["runs"]
    plain, inplace = runs["nn.ReLU()"], runs["nn.ReLU(inplace=True)"]
    # the truthful seed story: in-place ReLU keeps exactly the same activations for backward
    assert plain["activations_at_backward_start"] == inplace["activations_at_backward_start"] > 0
    assert plain["forward_new_bytes"] > inplace["forward_new_bytes"]
    assert plain["loss_per_epoch"] == inplace["loss_per_epoch"]
    # only the two tracked steps are measured: no dataset, no batch list, only the two target batches
    peak = plain["memory"]["peak_by_category"]
    assert peak["other"] <= 2 * 64 * 8
    assert peak["inputs"] == 2 * 64 * 784 * 4
    assert peak["parameters"] == peak["gradients"] == 971_048
    assert results["equivalence"]["verify_bitwise"] is True
    oib = results["optimizer_in_backward"]
    assert oib["verify_bitwise"] is True
    mem = oib["memory"]
    assert mem["in backward"]["peak_gradients"] <= mem["in backward"]["largest_bucket_bytes"] == 784 * 256 * 4
    assert mem["standard"]["peak_bytes"] - mem["in backward"]["peak_bytes"] > 0
    assert "gradients not compared" in oib["verify"]  # OptimizerInBackward needs no compare_grads=False
    checks = results["check_inplace"]
    assert checks["silu_inplace_1"]["ok"] is False and "values differ" in checks["silu_inplace_1"]["problems"][0]
    # the seed's second SiLU, quoted exactly: right values, but its backward fails, and the checker says why
    seed_2 = checks["silu_inplace_2"]
    assert seed_2["ok"] is False and not any("values differ" in p for p in seed_2["problems"])
    assert "sigmoid_ keeps its output for backward, and mul_ then overwrote it in place" in seed_2["problems"][0]
    assert checks["silu_inplace_2, corrected"]["ok"] is True
    assert checks["memtrim.functional.relu(save='mask')"]["activation_bytes"] == 64 * 128 // 8
    converted = results["convert"]
    assert converted["seed MLP"]["after"] == converted["seed MLP"]["before"]  # nothing safe to change, and said why
    assert converted["conv+BN+LeakyReLU CNN"]["after"] < 0.5 * converted["conv+BN+LeakyReLU CNN"]["before"]
    rev = results["reversible"]
    assert rev["verify_ok"] is True
    assert len(set(rev["curve"]["reversible"])) == 1  # constant in depth
    assert rev["curve"]["plain"][-1] > 5 * rev["curve"]["reversible"][-1]
    assert rev["drift"]["exact, depth 64"] == 0.0
    plan = results["plan"]  # the chosen plan fits the budget, and its predicted peak is the measured one
    assert plan["measured"] == plan["predicted"] <= plan["budget"]
    assert plan["chosen"] != "plain" and any(p["name"] == "plain" and not p["fits"] for p in plan["plans"])
    report = (tmp_path / "report.md").read_text()
    assert "memtrim demo report" in report and "bitwise" in report
    assert "sigmoid_ keeps its output for backward, and mul_ then overwrote it" in report
    assert "second is correct" not in report
    assert "## 8. Will it fit? `memtrim.plan`" in report and "(the same bytes)" in report
    printed = capsys.readouterr().out
    assert "standard standard" not in printed and "standard standard" not in report

    for name in ("timeline_relu.png", "timeline_relu_inplace.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_demo_quotes_the_seed_articles_silu_exactly():
    import inspect

    from memtrim.cli import demo

    body = inspect.getsource(demo.silu_inplace_2).split('"""')[-1].strip().splitlines()
    assert [line.strip() for line in body] == [
        "result = input.clone()", "torch.sigmoid_(input)", "input *= result", "return input",
    ]


def test_demo_bad_arguments(tmp_path, capsys):
    # a wrong --data leaves no report folder behind (it was made first; found by an adversarial pass on 2026-12-02)
    assert main(["demo", "--quick", "--out", str(tmp_path / "report"), "--data", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "report").exists()
    assert main(["demo", "--quick", "--out", str(tmp_path), "--device", "nodevice"]) == 2
    capsys.readouterr()
    # meta has no values: a traceback at the first loss.item() and exit 1 before (an adversarial pass on 2026-12-02)
    assert main(["demo", "--quick", "--out", str(tmp_path), "--device", "meta"]) == 2
    assert "cannot use device 'meta'" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("")  # --out naming a file: a traceback and exit 1 ("a problem found") before
    assert main(["demo", "--quick", "--out", str(tmp_path / "a_file")]) == 2
    assert "cannot write the report to --out" in capsys.readouterr().err


def test_demo_without_matplotlib_says_so_before_training(tmp_path, capsys, monkeypatch):
    # it trained the first run, then failed writing its plot (found by an adversarial pass on 2026-12-02)
    import memtrim.cli.demo as demo

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    trained = []
    monkeypatch.setattr(demo, "_train", lambda *a, **k: trained.append(a))
    assert main(["demo", "--quick", "--out", str(tmp_path / "report")]) != 0
    assert "matplotlib" in capsys.readouterr().err and not trained and not (tmp_path / "report").exists()


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "memtrim", "demo", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--quick" in out.stdout
