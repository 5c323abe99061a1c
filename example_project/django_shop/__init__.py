"""A small Django project using celery_guard: an order model, a charge task, the guard's app.

Run it (from the repository root; Redis on localhost, or DJANGO_SHOP_BROKER_URL)::

    python example_project/django_shop/manage.py migrate
    celery -A example_project.django_shop worker --loglevel INFO
    python example_project/django_shop/manage.py shell -c \
        "from example_project.django_shop.orders.tasks import charge; \
         from example_project.django_shop.orders.models import Order; \
         o = Order.objects.create(amount=100); print(charge.delay(o.id).get(timeout=30))"

docs/django.md walks through it. The Celery app is imported here, as Celery's Django guide
does, so that ``@shared_task`` and ``delay_on_commit`` use it.
"""

from .celery import app as celery_app

__all__ = ["celery_app"]
