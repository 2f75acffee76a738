"""Processes and devices: the distributed environment, strategy wrappers, the launcher, run health."""
