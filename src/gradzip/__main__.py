"""``python -m gradzip`` (also what ``torchrun -m gradzip train`` runs)."""

import sys

from gradzip.cli import main

sys.exit(main())
