"""`python -m recshard.calibration -o profile.json`: `recshard-plan calibrate` (under torchrun
too: `torchrun --nproc_per_node N -m recshard.calibration -o profile.json`)."""

import sys

from recshard.calibration.cli import calibrate_main

sys.exit(calibrate_main(sys.argv[1:], prog="python -m recshard.calibration"))
