"""MoE model pieces in plain PyTorch: router, all-to-all token dispatcher, grouped SwiGLU experts,
attention, the transformer layer as stages, and the model built from a `MoEModelConfig`.

Nothing here knows about schedules; the runtime's executor calls the stages in a schedule's order.
Importing this package does not import torch; its modules do.
"""
