# The three models move here from the gateway app (gateway 0003) with their tables: the
# state is created, the database is left as it is.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("registry", "0001_initial"),
        ("tenants", "0001_initial"),
        ("gateway", "0003_models_move_to_telemetry"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="EnergyAllocation",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("source_key", models.CharField(max_length=200, unique=True)),
                        ("agent", models.CharField(max_length=255)),
                        ("interval_start", models.DateTimeField()),
                        ("interval_end", models.DateTimeField()),
                        ("energy_joules", models.FloatField()),
                        ("attributed_joules", models.FloatField()),
                        ("tokens", models.PositiveBigIntegerField()),
                        ("shares", models.JSONField()),
                        ("created_at", models.DateTimeField(auto_now_add=True)),
                    ],
                    options={
                        "db_table": "gateway_energyallocation",
                        "ordering": ["-interval_start", "-id"],
                    },
                ),
                migrations.CreateModel(
                    name="PromptRecord",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("request_id", models.CharField(max_length=32, unique=True)),
                        ("prompt", models.TextField()),
                        ("completion", models.TextField()),
                        ("finished_at", models.DateTimeField()),
                        (
                            "tenant",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="prompt_records",
                                to="tenants.tenant",
                            ),
                        ),
                        (
                            "version",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.PROTECT,
                                related_name="prompt_records",
                                to="registry.modelversion",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "gateway_promptrecord",
                        "ordering": ["-finished_at", "-id"],
                        "indexes": [
                            models.Index(
                                fields=["tenant", "finished_at"],
                                name="gateway_pro_tenant__042579_idx",
                            )
                        ],
                    },
                ),
                migrations.CreateModel(
                    name="RequestSample",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("request_id", models.CharField(max_length=32, unique=True)),
                        ("deployment", models.CharField(max_length=100)),
                        ("agent", models.CharField(blank=True, max_length=255)),
                        ("endpoint_kind", models.CharField(max_length=20)),
                        ("status", models.PositiveSmallIntegerField()),
                        ("is_error", models.BooleanField()),
                        ("error_code", models.CharField(blank=True, default="", max_length=64)),
                        ("is_stream", models.BooleanField()),
                        ("ttft_s", models.FloatField(null=True)),
                        ("itl_mean_s", models.FloatField(null=True)),
                        ("itl_p95_s", models.FloatField(null=True)),
                        ("e2e_s", models.FloatField()),
                        ("prompt_tokens", models.PositiveIntegerField()),
                        ("completion_tokens", models.PositiveIntegerField()),
                        ("finished_at", models.DateTimeField()),
                        (
                            "tenant",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.PROTECT,
                                related_name="request_samples",
                                to="tenants.tenant",
                            ),
                        ),
                        (
                            "version",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.PROTECT,
                                related_name="request_samples",
                                to="registry.modelversion",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "gateway_requestsample",
                        "ordering": ["-finished_at", "-id"],
                        "indexes": [
                            models.Index(
                                fields=["version", "finished_at"],
                                name="gateway_req_version_cb2669_idx",
                            ),
                            models.Index(
                                fields=["agent", "finished_at"], name="gateway_req_agent_6ad60b_idx"
                            ),
                        ],
                    },
                ),
            ],
            database_operations=[],
        )
    ]
