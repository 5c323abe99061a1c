"""Test rig: private PostgreSQL/Redis servers and real Celery worker processes for the tests."""
