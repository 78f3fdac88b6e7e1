"""Training: batching (length-grouped, dynamically padded), the loop, fine-tuning methods.

Library code; the `train` and `evaluate` stages call it.
"""
