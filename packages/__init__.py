"""Layer packages: a GGUF split into per-layer artifacts plus a manifest (model-package.json)."""
