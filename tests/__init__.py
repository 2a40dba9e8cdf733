"""moetriton tests."""
