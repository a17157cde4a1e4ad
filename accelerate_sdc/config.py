"""SDC settings for Accelerate users: defaults < settings file < ``ACCELERATE_SDC_*`` < keywords.

* The settings file is ``sdc_config.yaml`` in accelerate's config directory (beside
  ``default_config.yaml``; ``$HF_HOME/accelerate`` by default), written by
  ``accelerate-sdc config``; ``ACCELERATE_SDC_CONFIG_FILE`` names another file.
* Every setting ``name`` can be overridden by the environment variable
  ``ACCELERATE_SDC_<NAME>`` (inherited by every process ``accelerate launch`` starts).
* Keyword arguments of ``SDCHooks`` override both.

One rule for every source (file, environment, keywords, ``accelerate-sdc config`` options): a
bool is ``true``/``false`` or ``1``/``0`` (as a bool, a number or a string, any case; not
``yes``/``on``), an integer is a whole number or a string of one, a number a finite number or a
string of one, a policy a string. An unknown name anywhere (a file key, an ``ACCELERATE_SDC_*``
variable, a keyword) is an error suggesting the closest known name; so is a bad value, also of a
check that is turned off. ``SDCConfigError`` names the key and where it came from.
"""

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
           "from_env", "read_file", "resolve"]  # fmt: skip


def default_file() -> Path:
    """Where ``accelerate-sdc config`` writes and ``SDCHooks`` reads the settings."""
    if os.environ.get(CONFIG_FILE_ENV):
        return Path(os.environ[CONFIG_FILE_ENV])
    from accelerate.commands.config.config_args import default_yaml_config_file

    return Path(default_yaml_config_file).with_name(FILE_NAME)


SOURCES = Sources(ENV_PREFIX, default_file)


def from_env(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Settings from ``ACCELERATE_SDC_<NAME>`` variables; any other ``ACCELERATE_SDC_*`` name
    (a typo) raises ``SDCConfigError`` with the closest known name."""
    return SOURCES.from_env(environ)


def resolve(**kwargs: Any) -> tuple[SDCSettings, dict[str, str]]:
    """Merge defaults, the settings file, the environment and ``kwargs``.

    Returns the settings and, for each key that was set, where its value came from.
    """
    return _resolve(SOURCES, **kwargs)

