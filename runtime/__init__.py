"""SpecDecode runtime: model loading, engine, proposers, verification and the HTTP server.

Importing this package must stay cheap and torch-free: the operator imports
``specdecode.runtime.config`` in an image without torch.
"""
