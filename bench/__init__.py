"""Benchmarks for celery_guard (run the scripts from the repository root)."""
