from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class SkipQueueConfig(AppConfig):
    name = "django_skipqueue"
    label = "skipqueue"  # names our tables forever: skipqueue_job, skipqueue_workerprocess
    verbose_name = _("Job queue")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Register checks and find tasks. Never touches the database."""
        from django_skipqueue import checks  # noqa: F401  (registers the checks)
        from django_skipqueue.tasks.registry import autodiscover

        # The django.tasks signals' receivers are connected by SkipQueueBackend when it
        # registers its first Task (tasks/signal_handlers.py).
        autodiscover()
