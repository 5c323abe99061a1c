"""The project's Celery app, configured from Django's settings (``CELERY_*``)."""

import os

from celery import Celery

import celery_guard.contrib.django

# Before the app is created, as Celery's "First steps with Django" does: Celery's Django fixup
# then sets Django up in the worker and closes its connections around every task.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.django_shop.settings")

app = Celery(
    "django_shop",
    # delay_on_commit() (Celery's DjangoTask) and the guard (GuardedTask) on every task.
    task_cls="celery_guard.contrib.django:GuardedDjangoTask",
)
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
celery_guard.contrib.django.install(app)
