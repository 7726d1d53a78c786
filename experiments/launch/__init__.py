"""Launching: sweeps as data, work units, local and XManager launchers, multi-host launch scripts, machine time."""
