"""Generation: the `Engine` interface and its implementations."""
