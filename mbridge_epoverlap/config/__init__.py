"""EP-overlap configuration: the validator, the environment it checks for, flex dispatcher gating,
recipes' config container and dotted overrides.

Importing this package does not import torch or Megatron-Core.
"""

from mbridge_epoverlap.config.comm_overlap import CommOverlapConfig
from mbridge_epoverlap.config.environment import GPU_CATALOG, Environment
from mbridge_epoverlap.config.flex import (
    FlexDispatcherWarning,
    apply_flex_dispatcher_backend,
    validate_flex_dispatcher_backend,
)
from mbridge_epoverlap.config.model import MoEModelConfig
from mbridge_epoverlap.config.violations import ConfigValidationError, Violation

__all__ = [
    "GPU_CATALOG",
    "CommOverlapConfig",
    "ConfigValidationError",
    "Environment",
    "FlexDispatcherWarning",
    "MoEModelConfig",
    "Violation",
    "apply_flex_dispatcher_backend",
    "validate_flex_dispatcher_backend",
]
