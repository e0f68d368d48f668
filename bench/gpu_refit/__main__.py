"""`python3 -m bench.gpu_refit` (from the repository root) or `python3 bench/gpu_refit`."""

import os
import sys

if __package__ in (None, ""):  # run as a folder: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))))

from bench.gpu_refit.cli import main  # noqa: E402

sys.exit(main())
