from __future__ import annotations

from django.db import models
from modelsearch import index


class Article(index.Indexed, models.Model):
    """Saving one enqueues modelsearch's `insert_or_update_object_task`."""

    title = models.CharField(max_length=200)

    search_fields = [index.SearchField("title")]

    def __str__(self) -> str:
        return self.title
