"""Rollout engines behind one protocol (hf, vllm)."""
