"""Tests of the Megatron-Core backend (weight mapping, layouts, GPTModel on CPU)."""
