"""`python -m recshard.port FILES...` (see `recshard.port.cli`)."""

import sys

from recshard.port.cli import main

sys.exit(main())
