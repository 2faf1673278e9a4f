"""Dashboard forms: they parse and validate input; services decide."""

from django import forms

from controlplane.tenants.models import ApiKeyScope


class ReasonForm(forms.Form):
    """A rollout transition: a reason is required, and the revision the user was looking at."""

    reason = forms.CharField(max_length=2000, strip=True)
    expected_revision = forms.IntegerField(min_value=0, required=False)
    full = forms.BooleanField(required=False)


class UndoForm(forms.Form):
    """Undo a deployment's last change of stable version; the service checks the reason too."""

    reason = forms.CharField(
        max_length=2000, strip=True, error_messages={"required": "A reason is required."}
    )


class AgentCommandForm(forms.Form):
    KINDS = [("drain", "Drain"), ("load", "Load version"), ("faults", "Inject faults (drill)")]

    kind = forms.ChoiceField(choices=KINDS)
    version_id = forms.IntegerField(min_value=1, required=False)
    latency_ms_per_token = forms.FloatField(min_value=0, max_value=10_000, required=False)
    error_rate = forms.FloatField(min_value=0, max_value=1, required=False)
    reason = forms.CharField(max_length=2000, strip=True)

    def clean(self) -> dict:
        data = super().clean() or {}
        if data.get("kind") == "load" and not data.get("version_id"):
            self.add_error("version_id", "Choose the version to load.")
        if data.get("kind") == "faults":
            for name in ("latency_ms_per_token", "error_rate"):
                if data.get(name) is None:
                    self.add_error(name, "Required for a drill.")
        return data


class ApiKeyCreateForm(forms.Form):
    name = forms.CharField(max_length=100, strip=True)
    scopes = forms.MultipleChoiceField(
        choices=ApiKeyScope.choices,
        widget=forms.CheckboxSelectMultiple,
        initial=list(ApiKeyScope.values),
    )
    expires_at = forms.DateTimeField(required=False)


class ApiKeyRevokeForm(forms.Form):
    reason = forms.CharField(max_length=2000, strip=True, required=False)


class AuditFilterForm(forms.Form):
    actor = forms.CharField(max_length=150, required=False, strip=True)
    object_type = forms.CharField(max_length=50, required=False, strip=True)
    object_id = forms.CharField(max_length=64, required=False, strip=True)
    action = forms.CharField(
        max_length=100,
        required=False,
        strip=True,
        help_text="An exact action, or a prefix ending in a dot (rollout.)",
    )


class UsageFilterForm(forms.Form):
    GRANULARITIES = [
        ("minute", "Per minute, last 2 hours"),
        ("hour", "Hourly, last 2 days"),
        ("day", "Daily, last 30 days"),
    ]

    granularity = forms.ChoiceField(choices=GRANULARITIES, required=False)


class AgentEnrolmentForm(forms.Form):
    agent_name = forms.RegexField(r"^[a-z0-9][a-z0-9_.-]{0,62}$", max_length=63, strip=True)
