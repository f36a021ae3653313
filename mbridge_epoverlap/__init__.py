"""Expert-parallel communication overlap for Mixture-of-Experts models.

Importing the package is cheap: torch, megatron-core and matplotlib are imported only by the
modules that use them.
"""

__version__ = "0.1.0"
