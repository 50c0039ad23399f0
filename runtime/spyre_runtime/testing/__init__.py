"""Test model folders, written here and holding no models: seeded random tiny models of every family the
runtime serves (models.py, with each family's writer: tiny_models.py for the decoder families, tiny_hybrid.py,
tiny_vision.py) and real small models rebuilt from PyPI wheels (SmolLM2, MiniLM). Used by the tests, the
benchmarks and the CLI's `tiny-model` and `prepare-model` commands; never by serving."""
