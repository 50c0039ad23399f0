"""The schedulers: the interface every engine loop drives (interface.py), the admission helpers they share
(admission.py), one module per policy (static.py, continuous.py, pooling.py) and the choice of policy from
the configuration (factory.py)."""
