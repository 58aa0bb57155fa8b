"""Measuring this machine and job for the planner: kernel, memory, link and step probes, their
fitting, and the `recshard-plan calibrate` command, which writes the `CalibrationProfile`
(`recshard.planner.profile`, data) that `Topology(profile=...)` plans with.

Top floor: it builds lookups, sharded modules and process groups to time them, so the
planner, which only reads the profile, never imports any of it.
"""

from recshard.calibration.fitting import fit_nonnegative
from recshard.calibration.grid import CalibrationGrid
from recshard.calibration.machine import calibrate, calibrate_job
from recshard.calibration.step import StepProbe

__all__ = ["CalibrationGrid", "StepProbe", "calibrate", "calibrate_job", "fit_nonnegative"]
