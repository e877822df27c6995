"""What the shim adds around the model: the embeds buffer, layer capture, the model's own hooks and their state mirror."""
