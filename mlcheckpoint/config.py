"""Old home of the settings, kept so imports written before ``mlcheckpoint.settings`` still
work; everything lives there now."""

from .settings import (  # noqa: F401
    DEFAULT_LOCAL_DIR,
    derived_job_id,
    filesystem_type,
    local_dir_errors,
    parse_bandwidth,
    parse_bytes,
    resolve_bandwidth,
    resolve_job_id,
    resolve_local_dir,
    resolve_memory_limit,
    validate_job_id,
    validate_keep,
    warn_if_not_memory,
)
