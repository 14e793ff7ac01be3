"""Drafter: the DFlash draft model, its training objective, export and acceptance evaluation."""
