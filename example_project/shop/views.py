from __future__ import annotations

from django.contrib.auth.models import User
from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_POST

from shop.tasks import deliver_webhook, send_welcome_email


@require_POST
def signup(request: HttpRequest) -> JsonResponse:
    """Create the user and enqueue the welcome email in one transaction.

    If the sign-up rolls back, the job never exists: no email for a user who isn't there.
    """
    username = request.POST.get("username", "")
    email = request.POST.get("email", "")
    if not username or User.objects.filter(username=username).exists():
        return JsonResponse({"error": "username missing or taken"}, status=400)
    with transaction.atomic():
        user = User.objects.create_user(username=username, email=email)
        job = send_welcome_email.enqueue(user.id)
    return JsonResponse({"user": user.id, "job": job.id}, status=201)


@require_POST
def ship_order(request: HttpRequest, order_id: int) -> JsonResponse:
    url = request.POST.get("callback", "https://hooks.example.com/orders")
    job = deliver_webhook.enqueue(url, {"order": order_id, "event": "shipped"})
    return JsonResponse({"job": job.id}, status=202)
