"""How much a decoder may allocate: bounds from what the receiver expects, not the wire.

Payloads come from other ranks over the network and from archives on disk: a few
bytes may declare a shape of 2^28 values. Every size a payload declares is checked
before anything of that size is allocated, against a budget the receiver sets from
what it expects: decoding a tensor of n values may allocate O(n + b) for b payload
bytes. ``Codec.decode_body`` opens ``decode_budget(n)`` for the whole chain; any
field inside it (a coded integer field, a nested compressor's values) may declare
at most ``FIELD_FACTOR * n + FIELD_SLACK`` values (generous: a payload's fields never
hold more values than its tensor, bar small tables and PowerSGD's factors of tiny
matrices). Outside any budget (a coder called on its own) ``DEFAULT_MAX_NUMEL`` holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from gradzip.codecs.payload import PayloadError

#: values a payload may declare when nothing else bounds it (``Codec.decode``'s
#: ``max_numel`` default): 128M values, 512 MB of fp32
DEFAULT_MAX_NUMEL = 1 << 27
#: a field of a payload for n values may declare FIELD_FACTOR * n + FIELD_SLACK values
FIELD_FACTOR = 4
FIELD_SLACK = 1 << 16

_BUDGET: ContextVar[int] = ContextVar("gradzip_decode_budget", default=DEFAULT_MAX_NUMEL)


@contextlib.contextmanager
def decode_budget(numel: int) -> Iterator[None]:
    """Bound every declared size while decoding a tensor of ``numel`` values."""
    token = _BUDGET.set(FIELD_FACTOR * numel + FIELD_SLACK)
    try:
        yield
    finally:
        _BUDGET.reset(token)


def check_declared(numel: int, what: str) -> int:
    """``numel`` if a payload may declare it here, else ``PayloadError`` (before any
    allocation of that size)."""
    limit = _BUDGET.get()
    if not 0 <= numel <= limit:
        raise PayloadError(f"{what} declares {numel} values; at most {limit} may be "
                           "decoded here (a corrupt or foreign payload)")
    return numel
