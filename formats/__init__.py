"""What lies on disk beside the method: gate files, saved caches, checkpoints' checks, safetensors
writing and hashes."""
