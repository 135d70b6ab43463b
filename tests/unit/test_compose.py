"""docker-compose.yml, checked without Docker: every service's command is one the CLI accepts,
its settings are ones the services read, and what it depends on and connects to exists."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from common.settings import Settings
from deepmesh.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
DEEPMESH = {name: s for name, s in SERVICES.items() if s.get("command", [None])[0] == "deepmesh"}


def test_the_stack_and_every_service_are_there():
    assert {"kafka", "postgres", "redis", "jaeger"} <= set(SERVICES)
    assert {"gateway", "tokenizer", "prefill", "decode", "cache", "model"} <= set(DEEPMESH)
    for name, service in SERVICES.items():
        if "image" in service and name not in DEEPMESH:
            assert re.fullmatch(r"[\w./-]+:[\w.-]+", service["image"]) and not service["image"].endswith(":latest")


@pytest.mark.parametrize("name", sorted(DEEPMESH))
def test_each_command_resolves(name):
    command = DEEPMESH[name]["command"]
    args = build_parser().parse_args(command[1:])  # exits (fails the test) on an unknown command or option
    assert args.command == command[1]
    if args.command in ("gateway", "cache"):
        assert args.host == "0.0.0.0"  # reachable from the other containers


@pytest.mark.parametrize("name", sorted(DEEPMESH))
def test_settings_are_read_and_point_at_services(name):
    environment = DEEPMESH[name]["environment"]
    known = {f"DEEPMESH_{field.upper()}" for field in Settings.model_fields}
    assert {k for k in environment if k.startswith("DEEPMESH_")} <= known
    settings = Settings(**{k.removeprefix("DEEPMESH_").lower(): v for k, v in environment.items() if k in known})
    assert settings.kafka_bootstrap.split(":")[0] in SERVICES
    for url in (
        settings.database_url,
        settings.redis_url,
        settings.cache_url,
        environment["OTEL_EXPORTER_OTLP_ENDPOINT"],
    ):
        assert urlsplit(url).hostname in SERVICES, url
    assert settings.model.startswith("/models/") and DEEPMESH["model"]["command"][2] == settings.model


def test_dependencies_exist_and_the_image_builds_every_package():
    for name, service in SERVICES.items():
        assert set(service.get("depends_on") or {}) <= set(SERVICES), name
    dockerfile = (ROOT / "Dockerfile").read_text()
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for package in packages:
        assert f"COPY {package.rstrip('*')} " in dockerfile


def test_celery_maintenance_runs_every_cache_task_on_a_schedule():
    from cache_svc.maintenance import TASKS, app

    command = SERVICES["maintenance"]["command"]
    assert command[:3] == ["celery", "-A", "cache_svc.maintenance"] and "--beat" in command
    assert "redis" in SERVICES["maintenance"]["depends_on"]
    # every scheduled name is a task a worker has registered (beat schedules names, not functions)
    scheduled = {entry["task"] for entry in app.conf.beat_schedule.values()}
    assert len(scheduled) == len(TASKS) and scheduled <= set(app.tasks)


def test_celery_runs_the_batch_runner_on_a_schedule():
    from gateway.batch_tasks import app

    command = SERVICES["batches"]["command"]
    assert command[:3] == ["celery", "-A", "gateway.batch_tasks"] and "--beat" in command
    assert "redis" in SERVICES["batches"]["depends_on"]
    scheduled = {entry["task"] for entry in app.conf.beat_schedule.values()}
    assert scheduled == {"deepmesh.batches.advance"} and scheduled <= set(app.tasks)
