"""Environments: the protocol every env speaks, and the built-in envs."""
