"""Product-layer helpers shared by the gateways (CLI, HTTP): media acquisition and prompt input."""
