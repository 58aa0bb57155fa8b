"""`python -m recshard.planner TABLES_FILE ...` runs the `recshard-plan` CLI."""

import sys

from recshard.planner.report.cli import main

sys.exit(main())
