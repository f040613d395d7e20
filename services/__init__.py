"""The rekv services (prefill, decode) and the `rekv` command that starts them."""
