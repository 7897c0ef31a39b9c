"""Model definitions and loaders (GGUF files, Hugging Face folders, packaged aliases)."""
