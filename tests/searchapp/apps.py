from __future__ import annotations

from django.apps import AppConfig


class SearchAppConfig(AppConfig):
    """A model indexed by modelsearch (Wagtail's search), whose index updates are tasks
    of the django-tasks backport: tests/integration/test_modelsearch.py. Installed only where
    modelsearch is (tests/settings.py)."""

    name = "tests.searchapp"
    label = "searchapp"
    default_auto_field = "django.db.models.BigAutoField"
