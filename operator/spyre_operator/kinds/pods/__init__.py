"""The model's serving pods: their template (template.py), what is read off them (observe.py), the rollout
plan (plan.py) and the step that applies it (step.py)."""
