"""``gradzip analyze``: how compressible captured gradients are, and what codecs cost.

``sources`` (archive, ``.pt`` directory or file -> buckets), ``measures`` (per-bucket
columns, from histograms, over bounded slices), ``whatif`` (each lossy codec's link bytes
and error through the simulated communicator), ``runner`` (worker processes, resumable
CSV/Parquet), ``summary`` (Markdown and PNG). No ``torch.distributed`` here.
"""
