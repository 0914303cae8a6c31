"""Comparing training runs: which method reaches the target quality soonest on a link.

``gradzip compare`` trains one model under a matrix of methods (gradzip specs and
PyTorch's own hooks) over a rate-limited link; its results records, or any
``results.jsonl`` of ``gradzip train``, are turned into a report here:

- ``matrix.py``: presets and the matrix of link settings x methods x seeds, and each
  run's ``gradzip train`` command;
- ``harness.py``: the link of each rate (shaped and measured, or why not), running a
  run in its namespace, annotating and keeping its record, the race figures;
- ``linkrate.py``: the probe that measures the rate a shaped link delivers;
- ``runs.py``: reading and checking records (errors name the file and line), and what
  each record is in a comparison: its link setting, method and seed;
- ``summary.py``: per setting, the baseline and target, time-to-target, the validation
  loss at a fixed time budget, and each method's figures aggregated over seeds;
- ``report.py``: ``write_report(records, out)`` (``report.md`` with tables and plots)
  and the same tables for the terminal;
- ``plots.py``: the PNG figures (loss against time and steps, the Pareto front, the
  step-time breakdown).
"""
