"""The Django app: its label, its migrations (the guard's tables) and its system checks."""

from __future__ import annotations

from django.apps import AppConfig
from django.core import checks

from .checks import check_celery_apps, check_database


class CeleryGuardConfig(AppConfig):  # type: ignore[misc]  # django ships no types
    """``"celery_guard.contrib.django"`` in ``INSTALLED_APPS``."""

    name = "celery_guard.contrib.django"
    label = "celery_guard"
    verbose_name = "Celery guard"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        checks.register(check_database)
        checks.register(check_celery_apps)
