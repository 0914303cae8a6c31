"""Gradient capture into HDF5 archives, and reading them back.

``gradzip.attach(model, spec, capture=Capture(dir, every=10))`` records each bucket as
it is communicated; ``Archive(dir)`` reads the archive; ``verify(dir)`` checks it.

Modules: ``layout`` (names and sizes), ``index`` (the SQLite index), ``packs`` (rolling
HDF5 packs), ``archive`` (reader and verify), ``writer`` (the background writer
thread), ``capture`` (what to capture, and when), ``convert`` (``.pt`` bucket files
into packs). Nothing here touches ``torch.distributed``: the hooks in ``comm`` hand
buckets to a ``Capture``.
"""

from __future__ import annotations

from gradzip.capture.archive import Archive, ArchiveError, Problem, verify
from gradzip.capture.index import Entry
from gradzip.capture.layout import StepKey, parse_size

__all__ = ["Archive", "ArchiveError", "Entry", "Problem", "StepKey", "parse_size", "verify"]
