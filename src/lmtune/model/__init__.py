"""The model side: loading, LoRA, the loss wrapper and its chunked head, attention, masks, precision
and its matrix products."""
