"""The example's background work."""

from __future__ import annotations

import random
import time
from datetime import timedelta

from django.contrib.auth.models import User
from django.core.mail import EmailMessage
from django.db import IntegrityError, transaction

from django_skipqueue import RetryPolicy, TaskContext, task
from shop.models import WelcomeEmail


@task(takes_context=True, max_attempts=5)
def send_welcome_email(context: TaskContext, user_id: int) -> str:
    """Send once per job, even if this attempt is a re-run after a crash."""
    user = User.objects.get(id=user_id)
    time.sleep(0.01)  # a mail server's round trip
    try:
        with transaction.atomic():
            WelcomeEmail.objects.create(idempotency_key=context.idempotency_key, user=user)
            EmailMessage(
                subject="Welcome!",
                body=f"Hello {user.username}, thanks for signing up.",
                to=[user.email],
                headers={"Idempotency-Key": context.idempotency_key},
            ).send()
    except IntegrityError:
        return "already sent"  # an earlier attempt of this job sent it
    return "sent"


class WebhookDownError(Exception):
    pass


@task(queue_name="webhooks", max_attempts=3, retry=RetryPolicy(base=0.05, cap=0.4))
def deliver_webhook(url: str, payload: dict, failure_rate: float = 0.3) -> int:
    """Pretend to POST `payload` to `url`; some endpoints are flaky, one is down for good."""
    time.sleep(0.005)
    if "down.example" in url or random.random() < failure_rate:
        raise WebhookDownError(f"POST {url} answered 503")
    return 200


@task(queue_name="reports")
def nightly_report(day: str) -> dict:
    return {"day": day, "signups": User.objects.count()}


def schedule_report(day: str, delay: timedelta) -> None:
    nightly_report.using(run_after=delay).enqueue(day)
