"""Real processes: two ranks share one cache directory; Ctrl-C leaves nothing behind."""

import json
import signal
import subprocess
import sys
import textwrap

import pytest
from train_helpers import default_sigint

RANK = textwrap.dedent("""
    import json, sys
    from gradzip.train.data import BatchLoader, DataConfig, prepare_data
    rank, cache, src = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    cfg = DataConfig(sources=[src], cache_dir=cache, vocab_size=300, wait_timeout=120)
    data = prepare_data(cfg, rank=rank, world_size=2)
    with BatchLoader(data.train, 4, 8, rank=rank, world_size=2, seed=0) as loader:
        firsts = [x[:, 0].tolist() for x, _ in (next(loader) for _ in range(5))]
    print(json.dumps({"tok": data.tokenizer.fingerprint(), "n": data.train.num_tokens,
                      "firsts": firsts}))
""")

CTRL_C = textwrap.dedent("""
    import sys, threading, time
    import numpy as np
    from gradzip.train.data.cache import Segment, TokenShards
    from gradzip.train.data.loader import BatchLoader
    path = sys.argv[1]
    np.arange(20000, dtype="<u2").tofile(path)
    loader = BatchLoader(TokenShards([Segment(path, "<u2", 0, 20000)]), 4, 32, prefetch=4)
    next(loader)
    print("ready", threading.active_count(), flush=True)
    while True:
        next(loader)
        time.sleep(0.01)
""")


@pytest.mark.dist
def test_two_rank_processes_share_one_build(tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": f"record {i} " * (3 + i % 5)}) + "\n"
                           for i in range(400)))
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(tmp_path / "c"), str(src)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (1, 0)]  # the waiting rank starts first
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        outs.append(json.loads(out))
    r1, r0 = outs
    assert r0["tok"] == r1["tok"] and r0["n"] == r1["n"]
    starts0 = {v for batch in r0["firsts"] for v in batch}
    starts1 = {v for batch in r1["firsts"] for v in batch}
    status = json.loads(next((tmp_path / "c").glob("data-*.status.json")).read_text())
    assert status["state"] == "done" and status["pid"] == procs[1].pid  # rank 0 built it
    assert r0["firsts"] != r1["firsts"] and starts0 and starts1



def test_ctrl_c_stops_a_prefetching_process(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C, str(tmp_path / "t.bin")],
                            preexec_fn=default_sigint,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready"), proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in err
    assert "Exception in thread" not in err  # the prefetch thread ended quietly
