# The request-sample, prompt-record and energy-allocation models now belong to the
# telemetry app (telemetry 0001); their tables stay where they are.

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("gateway", "0002_request_error_code"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.DeleteModel(name="EnergyAllocation"),
                migrations.DeleteModel(name="PromptRecord"),
                migrations.DeleteModel(name="RequestSample"),
            ],
            database_operations=[],
        )
    ]
