"""``pip install gradzip`` without extras is the library: codecs, ``attach``, DiLoCo.

The lab (trainer, compare, capture, analysis, benchmarks, the CLI's tables and bars)
comes with the ``lab`` extra. Here the lab's modules are refused at import, as in an
environment that never installed them, and the library must still compress a DDP run.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from gradzip.cli import LAB_MODULES as LAB_EXTRA

#: what only the extras install: the ``lab`` extra's modules, and the others'
LAB_MODULES = (*LAB_EXTRA, "transformers", "accelerate", "zipnn", "pyarrow")


REFUSE = f"""
import sys
for name in {LAB_MODULES!r}:
    sys.modules[name] = None  # import fails (ModuleNotFoundError), find_spec says absent
LAB = {LAB_MODULES!r}
"""

LIBRARY = REFUSE + """
import torch, torch.distributed as dist, gradzip
from gradzip.outer import DiLoCo
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
for spec in ("ef | topk(ratio=0.01) | eg", "int8 | ans", "lossless", "qsgd | eg",
             "powersgd(rank=2)", "demo"):
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 8))
    handle = gradzip.attach(model, spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(4, 64)).sum().backward(); opt.step(); opt.zero_grad()
        handle.stats.end_step()
    assert handle.stats.totals()["encode_ms"] > 0, spec  # it ran (1 rank: no link bytes)
    handle.close()
inner = torch.nn.Linear(8, 8)
inner_opt = torch.optim.SGD(inner.parameters(), lr=0.1)
outer = DiLoCo(inner, inner_opt, sync_every=2, codec="int8")
for _ in range(4):
    inner(torch.randn(2, 8)).sum().backward(); inner_opt.step(); inner_opt.zero_grad()
    outer.step()
outer.close()
dist.destroy_process_group()
print("LIBRARY OK", sorted(m for m in LAB if sys.modules.get(m) is not None))
"""


def test_the_library_works_without_the_lab_extra() -> None:
    proc = subprocess.run([sys.executable, "-c", LIBRARY], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LIBRARY OK []" in proc.stdout


@pytest.mark.parametrize("argv", [["codecs", "list"], ["archive", "ls", "x"]])
def test_a_lab_command_without_the_lab_extra_names_the_extra(argv: list[str]) -> None:
    code = REFUSE + f"from gradzip.cli import main; sys.exit(main({argv!r}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "pip install" in proc.stderr and "[lab]" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_numba_is_imported_only_when_a_chain_names_an_entropy_coder() -> None:
    code = ("import sys, gradzip\n"
            "gradzip.codec('ef | topk(ratio=0.01) | qsgd'); a = 'numba' in sys.modules\n"
            "gradzip.codec('qsgd | eg'); print(a, 'numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "True"]


def test_the_cli_knows_exactly_the_lab_extras_modules() -> None:
    """cli.LAB_MODULES names the extra to install; it must not drift from pyproject."""
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    lab = project["project"]["optional-dependencies"]["lab"]
    assert sorted(re.split(r"[<>=!~ \[]", r, maxsplit=1)[0] for r in lab) == sorted(LAB_EXTRA)
    assert not set(LAB_EXTRA) & {re.split(r"[<>=!~ \[]", r, maxsplit=1)[0]
                                 for r in project["project"]["dependencies"]}
