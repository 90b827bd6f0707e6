from django.db import models


class WelcomeEmail(models.Model):
    """One welcome email handed to the mail backend, keyed by the job's idempotency key."""

    idempotency_key = models.CharField(max_length=64, unique=True)
    user = models.ForeignKey("auth.User", on_delete=models.CASCADE)
    sent_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"welcome email to {self.user_id} ({self.idempotency_key})"
