"""Compute policy shared by the target, the drafter and the training step: how to compile
(``compute.compile``) and in which dtype to compute (``compute.precision``). Imports nothing above the run
formats, so the target and the drafter read it without importing each other."""
