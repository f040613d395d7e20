"""The rekv services: what runs in a pod. `services.prefill` and `services.decode` are the two
servers; beside them, what both share (serving, settings, metrics, errors, calls, wire_convert) and
the generated protobuf modules (`services.rpc`). The `rekv` command that starts them lives in
`rekv_cli`."""
