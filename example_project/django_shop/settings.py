"""Settings of the example Django project; the environment points it at other servers.

``DJANGO_SHOP_DATABASE_URL``: ``postgresql://user:password@host:port/name`` or
``sqlite:///path`` (default: ``db.sqlite3`` beside this file). ``DJANGO_SHOP_BROKER_URL`` and
``DJANGO_SHOP_RESULT_URL``: Redis URLs.
"""

import os
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

BASE_DIR = Path(__file__).resolve().parent

SECRET_KEY = os.environ.get("DJANGO_SHOP_SECRET_KEY", "example-only-not-secret")
DEBUG = os.environ.get("DJANGO_SHOP_DEBUG", "") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
USE_TZ = True
ROOT_URLCONF = "example_project.django_shop.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "celery_guard.contrib.django",
    "example_project.django_shop.orders",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]


def database(url: str) -> dict[str, Any]:
    """A ``DATABASES`` entry from a URL (PostgreSQL or SQLite)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": parsed.database,
            # Django's advice when several processes write one file (the workers, the store).
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 10},
        }
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parsed.database,
        "USER": parsed.username or "",
        "PASSWORD": parsed.password or "",
        "HOST": parsed.host or "",
        "PORT": str(parsed.port or ""),
    }


DATABASES = {
    "default": database(
        os.environ.get("DJANGO_SHOP_DATABASE_URL", f"sqlite:///{BASE_DIR / 'db.sqlite3'}")
    )
}

# Celery, read through the app's namespace="CELERY" (celery.py), celery_guard's keys included.
CELERY_BROKER_URL = os.environ.get("DJANGO_SHOP_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_RESULT_BACKEND = os.environ.get("DJANGO_SHOP_RESULT_URL", "redis://127.0.0.1:6379/1")
CELERY_TASK_DEFAULT_QUEUE = "django_shop"
CELERY_TASK_ALWAYS_EAGER = os.environ.get("DJANGO_SHOP_EAGER", "") == "1"
CELERY_GUARD_LEASE_TTL = float(os.environ.get("DJANGO_SHOP_LEASE_TTL", "10"))
CELERY_GUARD_BACKOFF_BASE = float(os.environ.get("DJANGO_SHOP_BACKOFF_BASE", "1"))
CELERY_GUARD_REAPER_INTERVAL = float(os.environ.get("DJANGO_SHOP_REAPER_INTERVAL", "2"))
CELERY_GUARD_METRICS_PORT = (
    int(os.environ["DJANGO_SHOP_METRICS_PORT"])
    if os.environ.get("DJANGO_SHOP_METRICS_PORT")
    else None
)
