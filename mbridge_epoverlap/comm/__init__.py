"""Communication: process groups, asynchronous all-to-all with timeouts, and their CUDA stream handling.

Importing this package does not import torch; its modules do.
"""
