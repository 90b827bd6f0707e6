"""The web side's metrics view, for teams that scrape the web application rather than
the workers: the queue gauges of `runtime.prometheus`, read from the database at most
every SKIPQUEUE['METRICS_SAMPLE_SECONDS'] per web process (a scrape in between costs no query).

Include `django_skipqueue.urls` (docs/howto/monitoring.md). Open to clients from
SKIPQUEUE["METRICS_ALLOWED_NETWORKS"] (the address Django sees: behind a proxy, set
REMOTE_ADDR from a header your proxy controls) and to users with the "view job"
permission; anyone else gets 403. Without prometheus_client (the [metrics] extra),
501 says so.
"""

from __future__ import annotations

import ipaddress
import threading
from typing import Any

from django.http import HttpRequest, HttpResponse

from django_skipqueue.conf import get_settings

_lock = threading.Lock()
_registry: Any = None
_gauges: Any = None


def metrics(request: HttpRequest) -> HttpResponse:
    if not _allowed(request):
        return HttpResponse(
            "Forbidden: metrics need a user with the 'view job' permission or a client in "
            "SKIPQUEUE['METRICS_ALLOWED_NETWORKS']\n",
            status=403,
            content_type="text/plain",
        )
    try:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        from django_skipqueue.runtime.prometheus import QueueGauges
    except ImportError:
        return HttpResponse(
            "Not implemented: metrics need prometheus_client: "
            "pip install 'django-skipqueue[metrics]'\n",
            status=501,
            content_type="text/plain",
        )
    global _registry, _gauges
    with _lock:  # one sample at a time per process, shared by its scrapes
        if _registry is None:
            _gauges = QueueGauges()
            _registry = CollectorRegistry()
            _registry.register(_gauges)
        _gauges.refresh_if_stale()
        body = generate_latest(_registry)
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)


def _allowed(request: HttpRequest) -> bool:
    user = getattr(request, "user", None)
    if user is not None and user.is_active and user.has_perm("skipqueue.view_job"):
        return True
    networks = get_settings().METRICS_ALLOWED_NETWORKS
    if not networks:
        return False
    try:
        client = ipaddress.ip_address(request.META.get("REMOTE_ADDR", ""))
    except ValueError:
        return False
    if isinstance(client, ipaddress.IPv6Address) and client.ipv4_mapped is not None:
        client = client.ipv4_mapped  # a server bound to [::] sees ::ffff:10.1.2.3
    return any(client in ipaddress.ip_network(net, strict=False) for net in networks)
