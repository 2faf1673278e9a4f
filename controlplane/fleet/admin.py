from django.contrib import admin

from controlplane.fleet.models import Agent, AgentCommand


@admin.register(Agent)
class AgentAdmin(admin.ModelAdmin):
    list_display = ["name", "host", "state", "endpoint", "loaded_version", "last_seen"]
    list_filter = ["state"]
    search_fields = ["name", "host"]
    readonly_fields = [field.name for field in Agent._meta.fields]


@admin.register(AgentCommand)
class AgentCommandAdmin(admin.ModelAdmin):
    list_display = ["command_id", "agent", "kind", "status", "created_at"]
    list_filter = ["kind", "status"]
    readonly_fields = [field.name for field in AgentCommand._meta.fields]
