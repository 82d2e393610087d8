"""Loading and saving HF checkpoints, and the built-in tiny model."""
