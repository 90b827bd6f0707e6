"""Pure values and rules, bottom of the package above `conf`: job states and the
transition table, the JSON payload, retry policies, cron expressions, redaction, and
the one place Django's and other libraries' internals are reached (`compat`).

Nothing here imports a model, opens a connection or starts a thread
(docs/explanation/architecture.md).
"""
