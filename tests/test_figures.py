"""gradzip draws its PNGs without touching the caller's matplotlib: a user who trains or
analyzes from a notebook keeps their backend (inline plots go on showing) and gradzip
never imports ``pyplot``, whose global figure registry would keep its figures alive."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

# The run: choose a backend as a notebook would, then draw every gradzip figure kind.
SCRIPT = textwrap.dedent("""
    import sys
    import matplotlib
    matplotlib.use("svg")
    from pathlib import Path
    import numpy as np
    from gradzip.analyze.summary import histogram, write_plots
    from gradzip.train.loop import plot_history

    out = Path(sys.argv[1])
    history = [{"step": 1, "train_loss": 3.0}, {"step": 2, "train_loss": 2.5, "val_loss": 2.7}]
    plot_history(history, out / "loss.png")
    rows = [{"step": str(s), "lossless_ratio": str(1.1 + s / 10),
             "fixed_eg_best_bits": "3.5", "fixed_entropy_bits": "3.2"} for s in range(4)]
    made = write_plots(rows, out)
    histogram(np.array([1.0, 2.0]), "lossless_ratio")
    print(matplotlib.get_backend(), "matplotlib.pyplot" in sys.modules, *sorted(made))
""")


def test_drawing_keeps_the_callers_backend_and_never_imports_pyplot(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True,
                          text=True, check=True)
    backend, pyplot, *made = done.stdout.split()
    assert backend == "svg" and pyplot == "False", done.stdout
    assert made == ["bits_over_steps.png", "hist_lossless_ratio.png"]
    for name in ("loss.png", *made):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG"), name
