"""Heartbeat writes as heap-only (HOT) updates where PostgreSQL can make them.

Ingest updates every agent's row and its current rollup row about once a second. An update
that changes no indexed column and finds room on the row's page writes no index entry:
`last_seen` loses its index (the lost-agent check reads the small table whole), the
rollups lose the index on `agent_id` alone (the unique (agent, bucket_start) index covers
it), and both tables leave room on each page for the next versions of their rows.
"""

import django.db.models.deletion
from django.db import migrations, models

FILLFACTOR = {"fleet_agent": 50, "fleet_agentsample": 70}


def set_fillfactor(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for table, percent in FILLFACTOR.items():
        schema_editor.execute(f"ALTER TABLE {table} SET (fillfactor = {percent})")


def reset_fillfactor(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for table in FILLFACTOR:
        schema_editor.execute(f"ALTER TABLE {table} RESET (fillfactor)")


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0001_initial"),
    ]

    operations = [
        migrations.AlterField(
            model_name="agent",
            name="last_seen",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AlterField(
            model_name="agentsample",
            name="agent",
            field=models.ForeignKey(
                db_index=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="samples",
                to="fleet.agent",
            ),
        ),
        migrations.RunPython(set_fillfactor, reset_fillfactor, elidable=False),
    ]
