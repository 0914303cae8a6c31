"""Collectives: how ranks exchange tensors, and what each exchange puts on the link.

Below the codecs: a ``Communicator`` (all-reduce, all-gather, all-to-all, reduce-scatter,
variable-sized byte exchanges, a flag carried on the next call) counts every call's bytes
with the link model (``linkmodel.py``). ``SimulatedCommunicator`` runs W virtual ranks in
one process; the real one on a process group is ``gradzip.comm.communicator``. Nothing
here knows what a codec is.
"""

from gradzip.collectives.agreement import StateDivergenceError
from gradzip.collectives.communicator import CommCounter, Communicator
from gradzip.collectives.linkmodel import link_bytes
from gradzip.collectives.simulated import SimulatedCommunicator, run_simulated, simulated_group

__all__ = [
    "CommCounter", "Communicator", "SimulatedCommunicator", "StateDivergenceError",
    "link_bytes", "run_simulated", "simulated_group",
]
