"""``python -m dofla ...`` runs the command line (``torchrun ... -m dofla linearize ...`` uses it)."""

import sys

from dofla.cli import main

sys.exit(main())
