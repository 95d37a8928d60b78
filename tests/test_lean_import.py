"""`import memtrim` starts no CUDA and imports no optional package."""

import subprocess
import sys


def test_import_is_lean():
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"  # torch itself may import some of these (it imports tqdm)
        "import memtrim\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'\n"
        "new = set(sys.modules) - before\n"
        "optional = ('matplotlib', 'tqdm', 'transformers', 'memcnn', 'revlib', 'torchtune', 'lomo_optim')\n"
        "bad = sorted(m for m in new if m.split('.')[0] in optional or m.startswith('memtrim.cli'))\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_public_api_listed():
    import memtrim

    for name in memtrim.__all__:
        assert hasattr(memtrim, name), name
    for name in ("track", "op_memory", "measure_step", "verify", "MemoryReport", "models", "data", "convert",
                 "check_inplace", "OptimizerInBackward", "ReversibleSequential", "AdditiveCoupling"):
        assert name in memtrim.__all__
    # submodules, kept out of __all__ so a star import cannot shadow torch.nn / torch.nn.functional
    assert "nn" not in memtrim.__all__ and "functional" not in memtrim.__all__
    assert hasattr(memtrim.nn, "BatchNormAct2d") and hasattr(memtrim.functional, "relu")
