"""``gradzip analyze``: how compressible captured gradients are, and what codecs cost.

``sources`` (archive, ``.pt`` directory or file -> buckets), ``measures`` (per-bucket
columns, from histograms, over bounded slices), ``whatif`` (each lossy codec's link bytes
and error through the simulated communicator), ``runner`` (worker processes, resumable
CSV/Parquet), ``summary`` (Markdown and PNG). No ``torch.distributed`` here.
"""

# The what-if's codecs unless --codecs says otherwise; here, not in whatif, so that
# `gradzip analyze --help` can print them without importing torch.
DEFAULT_CODECS = ("bf16", "int8", "qsgd | eg", "topk(ratio=0.01)", "efsignsgd",
                  "powersgd(rank=4)")
