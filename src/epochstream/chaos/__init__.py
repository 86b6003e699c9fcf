"""Chaos: which kills a run injects and when, as a pure plan the drivers carry out."""
