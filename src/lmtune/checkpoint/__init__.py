"""Checkpoints: the trainer's state, saving and verifying resumable checkpoints, Hugging Face export."""
