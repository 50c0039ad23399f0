"""The SpyreModel spec as the operator reads it: parsed and checked once (parse.py, pod_fields.py), into
frozen values (model_spec.py) whose model source is one type per scheme (model_source.py); where its cards
come from (placement.py) and what the runtime is told and would accept (runtime_contract.py)."""
