from django.apps import AppConfig


class OrdersConfig(AppConfig):
    name = "example_project.django_shop.orders"
    label = "orders"
