"""Every setting of mlcheckpoint, declared once, and the only place that reads the environment.

- ``declared.py``: the declarations (``SETTINGS``: name, variable, default, check, one line of
  documentation), the checks of one value, and ``variable_text``, the one reader of
  ``os.environ``;
- ``units.py``: sizes and rates as people write them ("8GiB", "1Gbit");
- ``launcher.py``: what the launcher says (``Launcher``, SLURM's topology) and the job id;
- ``resolved.py``: the objects the parts are handed: ``Options`` and ``ReplicationOptions``
  (a manager's settings, grouped by concern, kept as ``ckpt.options``), ``Tuning``
  (``tuning()``, ``tuned``) and ``Timeouts``.

No other library module reads ``os.environ`` (a test keeps it so). The crash and pause points
of ``_faults.py`` read their variables at each check through ``variable_text``: they are test
hooks, which a test's worker sets in its own environment between steps, not settings a part is
handed. A bad value of any setting raises ConfigError naming it when the manager is built
(``check_environment``), before anything is written. Whether a local_dir is fit to hold
checkpoints (tmpfs, writable, big enough) is ``tmpfs.py``'s; the tables of
docs/configuration.md are rendered by ``scripts/configuration_doc.py``.
"""

from .declared import (
    BY_ENV,
    BY_NAME,
    DEFAULT_LOCAL_DIR,
    ENV_VARS,
    MAX_REPLICAS,
    MAX_STREAMS,
    REPLICATION_MODES,
    SETTINGS,
    Setting,
    check_environment,
    default,
    resolve_local_dir,
    validate_job_id,
    validate_keep,
    variable_text,
)
from .launcher import Launcher, derived_job_id, resolve_job_id, secret_sources
from .resolved import (
    DEPRECATED_KEYWORDS,
    Options,
    ReplicationOptions,
    Timeouts,
    Tuning,
    native_loop,
    resolve_memory_limit,
    tuned,
    tuning,
)
from .units import parse_bandwidth, parse_bytes

__all__ = [
    "BY_ENV", "BY_NAME", "DEFAULT_LOCAL_DIR", "DEPRECATED_KEYWORDS", "ENV_VARS", "MAX_REPLICAS",
    "MAX_STREAMS", "REPLICATION_MODES", "SETTINGS", "Launcher", "Options", "ReplicationOptions",
    "Setting", "Timeouts", "Tuning", "check_environment", "default", "derived_job_id", "native_loop",
    "parse_bandwidth", "parse_bytes", "resolve_job_id", "resolve_local_dir",
    "resolve_memory_limit", "secret_sources", "tuned", "tuning", "validate_job_id",
    "validate_keep", "variable_text",
]
