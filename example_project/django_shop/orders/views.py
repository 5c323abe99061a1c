"""Placing an order: the charge is published only once the order's transaction committed."""

from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from .models import Order
from .tasks import charge


@csrf_exempt
@require_POST
def place_order(request: HttpRequest) -> JsonResponse:
    amount = int(request.POST["amount"])
    try:
        with transaction.atomic():
            order = Order.objects.create(amount=amount)
            charge.delay_on_commit(order.id)  # sent after COMMIT, never after a rollback
            if amount <= 0:
                raise ValueError("the amount must be positive")
    except ValueError as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    return JsonResponse({"order": order.id}, status=201)
