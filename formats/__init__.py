"""What lies on disk beside the method: the checks of a Hugging Face checkpoint folder
(checkpoint.py) and the files this project writes and reads (gate files, saved caches, safetensors),
each module named for the format it holds. The programs' edges import them; the method modules
never do."""
