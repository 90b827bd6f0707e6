"""A task declared with Django's own @task (Django >= 6.0); runs under any TASKS backend."""

from django.tasks import task


@task(queue_name="webhooks")
def order_shipped_notice(order_id: int) -> str:
    return f"order {order_id} shipped"
