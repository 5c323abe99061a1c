"""The shop's URLs: placing an order, and the admin (celery_guard's dead letters among it)."""

from django.contrib import admin
from django.urls import path

from .orders import views

urlpatterns = [
    path("orders/", views.place_order, name="place-order"),
    path("admin/", admin.site.urls),
]
