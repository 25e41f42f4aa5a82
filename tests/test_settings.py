"""Layered settings: defaults <- TOML <- environment <- flags, with errors naming the source."""

import argparse
from dataclasses import dataclass
from typing import Literal

import pytest

from paramserver.plumbing.settings import SettingsError, add_flags, load_settings, setting_keys


@dataclass(frozen=True)
class Demo:
    host: str = "127.0.0.1"  # interface to bind
    port: int = 5555  # first port; shard i uses port + 2i and port + 2i + 1
    rate: float = 0.5
    verbose: bool = False
    # where checkpoints go
    data_dir: str | None = None
    tags: tuple[str, ...] = ()
    mode: Literal["sync", "quorum", "async"] = "quorum"
    quorum: int = 2  # distinct islands per step

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}; pick a free TCP port")


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_defaults():
    cfg = load_settings(Demo, env={}, env_prefix="X_")
    assert cfg == Demo()


def test_precedence_file_env_flags(tmp_path):
    path = write(tmp_path, 'port = 6000\nrate = 1\nhost = "0.0.0.0"\nmode = "sync"\n')
    env = {"X_PORT": "7000", "X_VERBOSE": "yes", "X_QUORUM": "5", "OTHER": "1"}
    cfg = load_settings(
        Demo, file=path, env=env, env_prefix="X_", flags={"port": "8000", "tags": "a, b"}
    )
    assert cfg.port == 8000
    assert cfg.host == "0.0.0.0"
    assert cfg.rate == 1.0 and isinstance(cfg.rate, float)
    assert cfg.verbose is True
    assert (cfg.mode, cfg.quorum) == ("sync", 5)
    assert cfg.tags == ("a", "b")


def test_none_and_section(tmp_path):
    path = write(tmp_path, '[server]\ndata_dir = "/tmp/x"\nquorum = 3\n')
    cfg = load_settings(Demo, file=path, section="server")
    assert cfg.data_dir == "/tmp/x" and cfg.quorum == 3
    cfg = load_settings(
        Demo, file=path, section="server", env={"X_DATA_DIR": "none"}, env_prefix="X_"
    )
    assert cfg.data_dir is None


def test_unknown_toml_key_names_key_and_valid_ones(tmp_path):
    path = write(tmp_path, "prot = 1\n")
    with pytest.raises(
        SettingsError, match=r"c\.toml:prot: unknown setting; valid keys: host, port"
    ):
        load_settings(Demo, file=path)


def test_unknown_env_var():
    with pytest.raises(SettingsError, match="env X_PROT: unknown setting.*X_PORT"):
        load_settings(Demo, env={"X_PROT": "1"}, env_prefix="X_")


@pytest.mark.parametrize(
    "source, match",
    [
        ({"env": {"X_PORT": "abc"}}, r"env X_PORT: bad value 'abc': expected int"),
        ({"env": {"X_VERBOSE": "maybe"}}, r"env X_VERBOSE: bad value 'maybe': expected bool"),
        ({"flags": {"mode": "fast"}}, r"--mode: bad value 'fast': expected one of"),
        ({"flags": {"rate": "x"}}, r"--rate: bad value 'x': expected float"),
    ],
)
def test_bad_values_name_source_value_and_type(source, match):
    with pytest.raises(SettingsError, match=match):
        load_settings(Demo, env_prefix="X_", **{"env": {}, **source})


def test_bad_toml_type(tmp_path):
    path = write(tmp_path, 'port = "80a"\n')
    with pytest.raises(SettingsError, match=r"c\.toml:port: bad value '80a': expected int"):
        load_settings(Demo, file=path)


def test_post_init_error_names_source():
    with pytest.raises(SettingsError, match=r"^--port: port must be in 1\.\.65535, got 0"):
        load_settings(Demo, flags={"port": "0"})
    with pytest.raises(SettingsError, match=r"^env X_PORT: port must be"):
        load_settings(Demo, env={"X_PORT": "70000"}, env_prefix="X_")


def test_bad_or_missing_file(tmp_path):
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(Demo, file=tmp_path / "missing.toml")
    with pytest.raises(SettingsError, match="not valid TOML"):
        load_settings(Demo, file=write(tmp_path, "port = = 1"))


def test_settings_error_is_value_error():
    assert issubclass(SettingsError, ValueError)


def test_add_flags_only_given_values_and_help():
    parser = argparse.ArgumentParser()
    add_flags(parser, Demo, exclude=("verbose",))
    ns = parser.parse_args(["--port", "9000", "--mode", "async"])
    assert vars(ns) == {"port": "9000", "mode": "async"}
    assert load_settings(Demo, flags=ns) == Demo(port=9000, mode="async")
    text = parser.format_help()
    assert "shard i uses port + 2i" in text
    assert "where checkpoints go" in text
    assert "distinct islands per step" in text
    assert "--verbose" not in text
    assert setting_keys(Demo)[-2:] == ["mode", "quorum"]


@dataclass(frozen=True)
class Needs:
    connect: str
    retries: int = 1


def test_missing_required_setting_is_named():
    with pytest.raises(SettingsError, match="missing required setting 'connect'.*--connect"):
        load_settings(Needs)
    assert (
        load_settings(Needs, env={"N_CONNECT": "tcp://h:1"}, env_prefix="N_").connect == "tcp://h:1"
    )


def test_a_nested_table_is_an_unknown_setting(tmp_path):
    # settings are flat: a table other than the one section asked for names no field
    path = write(tmp_path, 'port = 6000\n[policy]\nmode = "sync"\n')
    with pytest.raises(SettingsError, match=r"c.toml:policy: unknown setting; valid keys: host"):
        load_settings(Demo, file=path)
