"""The SpecDecode operator: the SpecDecodeDeployment CRD and its pure core.

``spec`` (models) → ``crd`` (generated schema) → ``resolve`` (defaults, rules) → ``render``
(Kubernetes objects), with every shared name in ``names``. Nothing here imports torch; importing
this package imports nothing.
"""
