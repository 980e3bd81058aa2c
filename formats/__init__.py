"""What lies on disk beside the method: our gate files and the authors' .pt (gate_file), a
compressed KV cache saved to a file and read back (cache_file), safetensors written by hand,
streamed and ending in a checksum (tensor_file), and the checks of a Hugging Face checkpoint
folder (checkpoint). The method modules never import these; the programs' edges do, and every
user-facing check of what a file holds lives here."""
