from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "controlplane.tenants"
    label = "tenants"
