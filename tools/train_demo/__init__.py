"""Training recipe of the bundled demo package ``qwen3_6_demo`` (see README.md in this folder)."""
