"""Memory-saving techniques, each proven equal to plain training by tests built on ``memtrim.verify``."""
