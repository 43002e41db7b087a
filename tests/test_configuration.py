"""Settings: strict readers, one-line errors before anything starts, and a documented list that matches the code."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from genserver import config
from genserver.config import SettingsError, env_bool, env_choice, env_float, env_int, env_optional_int, env_pools
from workers.bundled_redis import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
VARIABLE = re.compile(r"\bGENSERVER_[A-Z0-9_]*[A-Z0-9]\b")
# Where the code reads (or, for the launcher, sets) its variables; the docs are checked against these.
SOURCE_DIRS = ("genserver", "workers", "tasks", "bench", "tests")
HANG_GUARD_SECONDS = 120  # a start-up that got past the settings would run for ever; this only stops a broken test


# --------------------------------------------------------------------------- the readers


def test_booleans_accept_the_usual_spellings_and_refuse_a_typo(monkeypatch):
    for raw, expected in (("1", True), ("Yes", True), ("on", True), ("0", False), ("FALSE", False), ("off", False)):
        monkeypatch.setenv("GENSERVER_WEBHOOK_ALLOW_PRIVATE", raw)
        assert env_bool("GENSERVER_WEBHOOK_ALLOW_PRIVATE", not expected) is expected
    monkeypatch.setenv("GENSERVER_WEBHOOK_ALLOW_PRIVATE", "ture")
    with pytest.raises(SettingsError) as caught:
        env_bool("GENSERVER_WEBHOOK_ALLOW_PRIVATE", False)
    assert str(caught.value) == (
        "GENSERVER_WEBHOOK_ALLOW_PRIVATE: 'ture' is not a boolean (accepted: 1/0, true/false, yes/no, on/off)"
    )
    monkeypatch.setenv("GENSERVER_WEBHOOK_ALLOW_PRIVATE", "  ")
    assert env_bool("GENSERVER_WEBHOOK_ALLOW_PRIVATE", True) is True  # blank means the default


def test_numbers_are_refused_out_of_range_or_malformed(monkeypatch):
    monkeypatch.setenv("GENSERVER_TIME_SCALE", "-1")
    with pytest.raises(SettingsError, match=r"^GENSERVER_TIME_SCALE: -1 is out of range \(accepted: a number > 0\)$"):
        env_float("GENSERVER_TIME_SCALE", 1.0, above=0)
    monkeypatch.setenv("GENSERVER_TIME_SCALE", "0")
    with pytest.raises(SettingsError, match="> 0"):
        env_float("GENSERVER_TIME_SCALE", 1.0, above=0)
    monkeypatch.setenv("GENSERVER_TIME_SCALE", "nan")
    with pytest.raises(SettingsError, match="not a finite number"):
        env_float("GENSERVER_TIME_SCALE", 1.0, above=0)
    monkeypatch.setenv("GENSERVER_TIME_SCALE", "0.02")
    assert env_float("GENSERVER_TIME_SCALE", 1.0, above=0) == 0.02
    monkeypatch.setenv("GENSERVER_MAX_ATTEMPTS", "2.5")
    with pytest.raises(SettingsError, match=r"'2.5' is not a whole number \(accepted: a whole number >= 1\)"):
        env_int("GENSERVER_MAX_ATTEMPTS", 3, minimum=1)
    monkeypatch.setenv("GENSERVER_EMBEDDED_REDIS_PORT", "70000")
    with pytest.raises(SettingsError, match=">= 1 and <= 65535"):
        env_int("GENSERVER_EMBEDDED_REDIS_PORT", 6389, minimum=1, maximum=65535)
    monkeypatch.delenv("GENSERVER_IMAGE_CARDS", raising=False)
    assert env_optional_int("GENSERVER_IMAGE_CARDS", minimum=0) is None


def test_choices_match_without_case_and_name_the_alternatives(monkeypatch):
    monkeypatch.setenv("GENSERVER_LOG_LEVEL", "warning")
    assert env_choice("GENSERVER_LOG_LEVEL", "INFO", config.LOG_LEVELS) == "WARNING"
    monkeypatch.setenv("GENSERVER_LOG_LEVEL", "loud")
    with pytest.raises(SettingsError, match=r"\(accepted: DEBUG, INFO, WARNING, ERROR, CRITICAL\)$"):
        env_choice("GENSERVER_LOG_LEVEL", "INFO", config.LOG_LEVELS)


def test_a_pool_layout_is_checked_when_read(monkeypatch, tmp_path):
    monkeypatch.setenv("GENSERVER_POOLS", '{"workers": [')
    with pytest.raises(SettingsError, match=r"^GENSERVER_POOLS: not valid JSON .*\(accepted: inline JSON"):
        env_pools()
    monkeypatch.setenv("GENSERVER_POOLS", '{"workers": [{"name": "a", "queues": ["shrt"]}]}')
    with pytest.raises(SettingsError, match="unknown queues"):
        env_pools()
    monkeypatch.setenv("GENSERVER_POOLS", str(tmp_path / "missing.toml"))
    with pytest.raises(SettingsError, match="neither JSON nor an existing file"):
        env_pools()
    good = tmp_path / "pools.toml"
    good.write_text('[[workers]]\nname = "a"\nqueues = ["short", "medium", "long", "encode", "decode"]\n')
    monkeypatch.setenv("GENSERVER_POOLS", str(good))
    assert env_pools() == str(good)


def test_the_runtime_reads_its_variables_strictly_at_call_time(monkeypatch):
    monkeypatch.setenv("GENSERVER_GROUP_SIZE", "4")
    assert config.group_size() == 4
    monkeypatch.setenv("GENSERVER_GROUP_SIZE", "0")
    with pytest.raises(SettingsError, match="GENSERVER_GROUP_SIZE"):
        config.group_size()
    monkeypatch.setenv("GENSERVER_VAE_TILE_ABOVE_PIXELS", "lots")
    with pytest.raises(SettingsError, match="GENSERVER_VAE_TILE_ABOVE_PIXELS: 'lots' is not a whole number"):
        config.vae_tile_above_pixels()
    monkeypatch.setenv("GENSERVER_WORKER_QUEUES", "short,medium")
    assert config.worker_queues() == ["short", "medium"]


# --------------------------------------------------------------------------- entry points: one line, exit 2


def _run(argv: list[str], data_dir: Path, **bad: str) -> subprocess.CompletedProcess:
    """Run an entry point against the real settings module with one bad variable; nothing shared is touched."""
    # REDIS_URL unset: the stack would start its own Redis; PROMETHEUS_MULTIPROC_DIR unset: `make up`
    # empties the folder it names of value files, and this process set it to the session's.
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "PROMETHEUS_MULTIPROC_DIR")}
    env |= {
        "DJANGO_SETTINGS_MODULE": "genserver.settings",
        "GENSERVER_DATA_DIR": str(data_dir),
        "GENSERVER_EMBEDDED_REDIS_PORT": str(free_port()),
        "GENSERVER_PORT": str(free_port()),
        "FLOWER_PORT": str(free_port()),
    } | bad
    return subprocess.run(
        [sys.executable, *argv],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_SECONDS,
        check=False,
    )


def _assert_one_line(out: subprocess.CompletedProcess, variable: str) -> None:
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"genserver: {variable}: "), out.stderr
    assert "(accepted: " in lines[0] and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("GENSERVER_POOLS", '{"workers": [{"name": "card0", "queues": ["shrt"]}]}'),
        ("GENSERVER_WEBHOOK_ALLOW_PRIVATE", "ture"),
    ],
)
def test_make_up_refuses_a_bad_setting_before_starting_anything(tmp_path, variable, value):
    out = _run(["-m", "workers.stack"], tmp_path, **{variable: value})
    _assert_one_line(out, variable)
    assert not (tmp_path / "redis").exists()  # the bundled Redis never started
    assert not (tmp_path / "genserver.sqlite3").exists()  # nor the migrations, the API or a worker
    assert "genserver is up" not in out.stdout


def test_make_up_refuses_flower_beyond_loopback_without_its_basic_auth(tmp_path):
    out = _run(["-m", "workers.stack"], tmp_path, FLOWER_ADDRESS="0.0.0.0", FLOWER_BASIC_AUTH="")
    _assert_one_line(out, "FLOWER_BASIC_AUTH")
    assert "FLOWER_ADDRESS=0.0.0.0" in out.stderr
    assert not (tmp_path / "redis").exists()


def test_flower_logins_are_checked_and_make_up_says_how_to_reach_flower(monkeypatch):
    from genserver import config
    from workers.stack import flower_access

    for address in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        monkeypatch.setenv("FLOWER_ADDRESS", address)
        monkeypatch.delenv("FLOWER_BASIC_AUTH", raising=False)
        assert config.is_loopback(address) and config.flower_basic_auth() == ""
        reach = flower_access(address, 5555, "")
        assert "this machine only" in reach and reach.startswith(
            ("http://127.0.0.", "http://[::1]", "http://localhost")
        )
    for address in ("0.0.0.0", "::", "192.0.2.7", "flower.example.com"):
        monkeypatch.setenv("FLOWER_ADDRESS", address)
        monkeypatch.delenv("FLOWER_BASIC_AUTH", raising=False)
        with pytest.raises(SettingsError, match="FLOWER_BASIC_AUTH"):
            config.flower_basic_auth()
        monkeypatch.setenv("FLOWER_BASIC_AUTH", "ops:s3cret,alice:pw")
        assert config.flower_basic_auth() == "ops:s3cret,alice:pw"
        reach = flower_access(address, 5555, config.flower_basic_auth())
        assert "basic auth: user ops, alice" in reach and "s3cret" not in reach
    for bad in ("ops", "ops:", ":pw", "ops:pw,bob"):
        monkeypatch.setenv("FLOWER_BASIC_AUTH", bad)
        with pytest.raises(SettingsError, match="user:password"):
            config.flower_basic_auth()


def test_make_up_refuses_a_generated_layout_that_cannot_be_built(tmp_path):
    out = _run(
        ["-m", "workers.stack"],
        tmp_path,
        GENSERVER_POOLS="",
        GENSERVER_NUM_GPUS="0",
        GENSERVER_CPU_WORKERS="1",
        GENSERVER_IMAGE_CARDS="1",
    )
    _assert_one_line(out, "GENSERVER_IMAGE_CARDS")
    assert not (tmp_path / "redis").exists()


@pytest.mark.parametrize(
    ("argv", "variable", "value"),
    [
        (["manage.py", "check"], "GENSERVER_TIME_SCALE", "-1"),
        (["manage.py", "check"], "GENSERVER_REGISTRY", "/nonexistent/registry.toml"),
        (["-m", "workers.launcher", "--print"], "GENSERVER_MAX_ATTEMPTS", "three"),
    ],
)
def test_manage_py_and_the_launcher_refuse_a_bad_setting_in_one_line(tmp_path, argv, variable, value):
    _assert_one_line(_run(argv, tmp_path, **{variable: value}), variable)


# --------------------------------------------------------------------------- the documented list


def _names_in_code() -> set[str]:
    names = set()
    for folder in SOURCE_DIRS:
        for path in (REPO_ROOT / folder).rglob("*.py"):
            names |= set(VARIABLE.findall(path.read_text()))
    names |= set(VARIABLE.findall((REPO_ROOT / "manage.py").read_text()))
    return names


def test_configuration_md_lists_every_variable_the_code_reads_and_no_other():
    documented = set(VARIABLE.findall((REPO_ROOT / "docs" / "CONFIGURATION.md").read_text()))
    in_code = _names_in_code()
    assert {"GENSERVER_LOG_LEVEL", "GENSERVER_WORKER_LOGLEVEL", "GENSERVER_VAE_TILE_ABOVE_PIXELS"} <= in_code
    assert in_code - documented == set(), "read by the code but missing from docs/CONFIGURATION.md"
    assert documented - in_code == set(), "in docs/CONFIGURATION.md but read nowhere"
