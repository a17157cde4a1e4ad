"""SDC settings for Accelerate users: defaults < settings file < ``ACCELERATE_SDC_<NAME>`` < keywords.

The settings file is ``sdc_config.yaml`` in accelerate's config directory (written by ``accelerate-sdc config``);
``ACCELERATE_SDC_CONFIG_FILE`` names another. Every source follows the rules of ``sdc_core.driver.settings``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sdc_core.driver.settings import SDCConfigError, SDCSettings, Sources, read_file
from sdc_core.driver.settings import resolve as _resolve

ENV_PREFIX = "ACCELERATE_SDC_"
CONFIG_FILE_ENV = ENV_PREFIX + "CONFIG_FILE"
FILE_NAME = "sdc_config.yaml"

__all__ = ["CONFIG_FILE_ENV", "ENV_PREFIX", "FILE_NAME", "SOURCES", "SDCConfigError", "SDCSettings", "default_file",
           "read_file", "resolve"]  # fmt: skip


def default_file() -> Path:
    """Where ``accelerate-sdc config`` writes and ``SDCHooks`` reads the settings."""
    if os.environ.get(CONFIG_FILE_ENV):
        return Path(os.environ[CONFIG_FILE_ENV])
    from accelerate.commands.config.config_args import default_yaml_config_file

    return Path(default_yaml_config_file).with_name(FILE_NAME)


SOURCES = Sources(ENV_PREFIX, default_file)


def resolve(**kwargs: Any) -> tuple[SDCSettings, dict[str, str]]:
    """The settings merged from every source, and where each set key's value came from."""
    return _resolve(SOURCES, **kwargs)
