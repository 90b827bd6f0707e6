"""URLs to include for the web side's metrics: `path("skipqueue/",
include("django_skipqueue.urls"))` serves /skipqueue/metrics (see views.py)."""

from django.urls import path

from django_skipqueue import views

app_name = "skipqueue"
urlpatterns = [path("metrics", views.metrics, name="metrics")]
