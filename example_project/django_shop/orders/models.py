"""An order, and the charges a task makes for it (no unique constraint: a duplicate shows)."""

from django.db import models


class Order(models.Model):
    amount = models.IntegerField()
    status = models.CharField(max_length=16, default="new")


class Charge(models.Model):
    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="charges")
    amount = models.IntegerField()
    #: The execution's fencing token and attempt number: which execution wrote the row.
    fencing_token = models.BigIntegerField()
    attempt = models.IntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
