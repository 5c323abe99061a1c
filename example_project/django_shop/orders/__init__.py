"""Orders and their charges."""
