from django.contrib import admin
from django.urls import path

from shop import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("signup/", views.signup, name="signup"),
    path("orders/<int:order_id>/ship/", views.ship_order, name="ship-order"),
]
