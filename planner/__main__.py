"""`python -m planner` runs the `rdma-plan` CLI."""

import sys

from planner.cli import main

sys.exit(main())
