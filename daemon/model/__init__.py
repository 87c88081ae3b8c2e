"""The Paddle model (rank processes only; imports paddle)."""
