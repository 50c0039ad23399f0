"""Model sources: download a model folder from `hf://` or `s3://` into a shared volume, verified and
published atomically (`spyre-runtime fetch-model`, the operator's loader Job).

uri.py (parse a source) → remote.py (what a source lists) → s3.py | hf.py (the two stores, through boto3
and huggingface_hub) → staging.py (DIR.partial, resume state, manifest, atomic rename) and progress.py
(JSON lines, the pod annotation) → fetch.py (the whole run: cached? space? download, verify, publish)."""
