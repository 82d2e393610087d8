"""reinforge: reinforcement learning for language models.

Importing the package is cheap (no torch); heavy modules load when a command needs them.
"""

__version__ = "0.1.0"
