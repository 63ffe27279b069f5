"""Plans made once per input: the direct kernel's knobs and the per-device tune cache."""
