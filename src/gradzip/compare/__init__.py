"""Comparing training runs: which method reaches the target quality soonest on a link.

``gradzip compare`` trains one model under a matrix of methods (gradzip specs and
PyTorch's own hooks) over a rate-limited link; its results records, or any
``results.jsonl`` of ``gradzip train``, are turned into a report here:

- ``runs.py``: reading and checking records (errors name the file and line), and what
  each record is in a comparison: its link setting, method and seed;
- ``summary.py``: per setting, the baseline and target, time-to-target, the validation
  loss at a fixed time budget, and each method's figures aggregated over seeds;
- ``report.py``: ``write_report(records, out)`` (``report.md`` with tables and plots)
  and the same tables for the terminal;
- ``plots.py``: the PNG figures (loss against time and steps, the Pareto front, the
  step-time breakdown).
"""
