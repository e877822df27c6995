"""Hot upgrade: the handing-over side, the taking-over side, the state between them, the warm spare."""
