"""The broker depth probe (`broker_depths`) against the real RabbitMQ: quiet about
the missing queues it looks for, and nothing else of the user's logging touched."""

from __future__ import annotations

import logging
from io import StringIO

import pytest
from django.core.management import call_command

from django_skipqueue.broker import relay_config
from django_skipqueue.broker.topology import broker_depths

pytestmark = [pytest.mark.django_db]


def pika_records(caplog) -> list[str]:
    return [
        f"{r.name} {r.levelname} {r.getMessage()}"
        for r in caplog.records
        if r.name == "pika" or r.name.startswith("pika.")
    ]


def test_queuestats_prints_no_pika_chatter_for_a_missing_broker_queue(relayed, caplog):
    caplog.set_level(logging.INFO)  # a project whose root logger is at INFO
    out = StringIO()
    call_command("queuestats", stdout=out)
    assert pika_records(caplog) == []
    [line] = [line for line in out.getvalue().splitlines() if line.startswith(relayed)]
    assert line.split()[-2:] == ["0", "0"]  # missing: no message ready, none dead


def test_the_probe_leaves_the_pika_loggers_as_it_found_them(relayed, caplog):
    caplog.set_level(logging.INFO)
    channel = logging.getLogger("pika.channel")
    channel.setLevel(logging.DEBUG)
    try:
        filters = {name: list(logging.getLogger(name).filters) for name in ("pika", "pika.channel")}
        assert broker_depths(relay_config()) == {relayed: (0, 0)}
        assert {n: list(logging.getLogger(n).filters) for n in filters} == filters
        assert channel.level == logging.DEBUG
        channel.warning("the project's own pika logging still gets through")
        assert pika_records(caplog) == [
            "pika.channel WARNING the project's own pika logging still gets through"
        ]
    finally:
        channel.setLevel(logging.NOTSET)
